"""The transports: moving tensors between two ranks, and nothing of the protocol.

`transport.py` is the interface; `rendezvous.py` the rendezvous store and CPU control channel
every transport shares (with its secret `gate.py`, the channels' `channel_address.py`, the
filter that admits only a group's members to its listeners, `listener_filter.py`, and each
attention member's own link, `member_links.py`); the data channels are `gloo.py` (CPU) and
`device_transport.py` (accelerators: `device.py`'s runtime and watchdog, NCCL in `nccl.py`).
"""
