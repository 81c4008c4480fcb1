# mk/images.mk -- the container images, built on this machine with no registry, and the host packages for them.
#
#   make images          scripts/images: a Debian bookworm base from debootstrap, then the Dockerfile's `base`
#                        and `train` targets (buildah bud --layers) and the pause image (images/pause), each
#                        exported as a docker-archive tarball for `ctr -n k8s.io images import`. Prints one
#                        `name=ref tarball` line per image (also in ~/.cache/phalanx/images/images.json).
#                        Cold: ~10 min on 2 cores (+ a one-time ~3 GB torch wheel download); warm: at once.
#   make host-packages   scripts/host-packages: apt-get installs buildah, debootstrap, containerd, runc, the CNI
#                        plugins, iptables and conntrack when missing (as root only; idempotent, no apt call
#                        when all are there). `make test` runs it first, then scripts/prepare-tests builds the
#                        images (and the Go tools) before pytest.
#   make test-images     the image tests (tests/shipping/test_images.py): build, run `phalanx --help` in the base
#                        image and `import torch, phalanx` in the train image as uid 10001, the pause program.

.PHONY: images host-packages test-images

host-packages:
	@scripts/host-packages

images: setup host-packages
	@scripts/images

test-images: setup host-packages
	$(BIN)/python -m pytest tests/shipping/test_images.py tests/shipping/test_dockerfile.py $(PYTEST_ARGS)
