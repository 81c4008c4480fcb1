"""The node agent behind ``phalanx-run``: worker supervision and restart, progress beacons, hang detection,
health probes and the host side of the flash checkpoint. Never imports torch."""
