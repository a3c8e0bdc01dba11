"""Who is in the deployment: start-up membership (claims, roll call, each group's handshake),
the formation after an FFN loss, a restarted attention server's rejoin, an FFN rank's group
formed again under a new epoch, and an attention rank's return once its FFN rank was lost.
"""
