"""The master's pure decisions over plain values: the failure policy (what a failure leads to), rendezvous
(when a round completes and who is in it), and when waiting nodes are folded in. No state, no I/O."""
