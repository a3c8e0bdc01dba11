"""The step protocol over a transport: the control and status messages, the order and tags
of a step's data operations, the attention side and the FFN side of a step (its inbox, its
assembly from the peers' messages, its data path), and the idle links' heartbeats.
"""
