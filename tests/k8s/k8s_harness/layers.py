"""Importing an image into a node the way a registry pull would: only the layers the node lacks.

``ctr images import`` of a docker-archive reads, hashes and stores every layer again, even the ones the node
has: 90 s for the 6 GB worker image on 2 cores, though a source change alters only phalanx's own top layer of
a few MB. The layers of a docker-archive are uncompressed tars named by their digests (the config's
``rootfs.diff_ids``), which are also the digests containerd stored them under. So an OCI archive made of the
manifest, the config and the missing layers names the whole image, and importing it takes seconds: containerd
finds every other layer in its content store, and their snapshots unpacked already."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

# Past this many missing bytes (a node's first import, a new torch) the docker-archive is imported as it is:
# the delta archive would be a second copy of most of it.
DELTA_LIMIT_BYTES = 512 << 20

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
NAME_ANNOTATION = "io.containerd.image.name"  # the full name containerd gives an imported manifest


def write_delta(docker_archive: Path, have: set[str], out: Path, *, names: set[str]) -> bool:
    """Writes to ``out`` an OCI archive of ``docker_archive``'s image named ``names`` (as containerd names
    them), holding only the layers whose digests are not in ``have``. False, and nothing written, when more
    than :data:`DELTA_LIMIT_BYTES` of layers are missing or the archive is not a one-image docker-archive."""
    with tarfile.open(docker_archive) as archive:
        entries = json.loads(_read(archive, "manifest.json"))
        if len(entries) != 1:
            return False
        config = _read(archive, entries[0]["Config"])
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]
        layers = [archive.getmember(name) for name in entries[0]["Layers"]]
        if len(layers) != len(diff_ids) or any(not m.isfile() for m in layers):
            return False
        missing = [(d, m) for d, m in zip(diff_ids, layers, strict=True) if d not in have]
        if sum(m.size for _, m in missing) > DELTA_LIMIT_BYTES:
            return False
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST_TYPE,
                "config": _descriptor(CONFIG_TYPE, config),
                "layers": [
                    {"mediaType": LAYER_TYPE, "digest": d, "size": m.size}
                    for d, m in zip(diff_ids, layers, strict=True)
                ],
            }
        ).encode()
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {**_descriptor(MANIFEST_TYPE, manifest), "annotations": {NAME_ANNOTATION: name}}
                for name in sorted(names)
            ],
        }
        with tarfile.open(out, "w") as delta:
            _add(delta, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
            _add(delta, "index.json", json.dumps(index).encode())
            for blob in (manifest, config):
                _add(delta, _blob_path(_digest(blob)), blob)
            for digest, member in missing:
                info = tarfile.TarInfo(_blob_path(digest))
                info.size = member.size
                delta.addfile(info, archive.extractfile(member))
    return True


def _read(archive: tarfile.TarFile, name: str) -> bytes:
    f = archive.extractfile(name)
    if f is None:
        raise ValueError(f"{name} is not a file in the archive")
    return f.read()


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _descriptor(media_type: str, data: bytes) -> dict[str, object]:
    return {"mediaType": media_type, "digest": _digest(data), "size": len(data)}


def _blob_path(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return f"blobs/{algorithm}/{hexdigest}"


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))
