"""Checkpoints encrypted at rest (``dmsc up --encrypt-checkpoints``): AES-256-GCM from
``cryptography``, the key kept outside every checkpoint folder.

The key is 32 random bytes in ``$DMSC_HOME/keys/checkpoints.key`` (mode 0600, its folder 0700),
made the first time it is asked for. The control plane holds it (:func:`install`) and hands it
to each worker in its start configuration, as it does the worker's certificate (never in a file
others may read); a process that holds it seals every checkpoint file it writes and opens sealed
ones it reads (:mod:`.checkpoints`). A plain file is still read as it is: turning encryption on
keeps older checkpoints usable.

A sealed file is ``MAGIC``, a random 12-byte nonce, then the GCM ciphertext of the whole
safetensors file with its 16-byte tag; the additional data names the file's part (``weights`` or
``optimizer``), so a stage's two files cannot stand in for each other. The integrity check does
not change: the SHA-256 the control plane keeps covers the files as they lie on disk (sealed),
and is checked before anything is decrypted; the GCM tag then refuses a file sealed with
another key. The whole file is held in memory to seal or open it (twice its size at the peak).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"DMSCAES1"
NONCE_BYTES = 12
KEY_BYTES = 32

_key: bytes | None = None


class SealError(ValueError):
    """A sealed file that cannot be opened here (no key, another key, or altered)."""


def key_file(home: Path) -> Path:
    return home / "keys" / "checkpoints.key"


def home_key(home: Path) -> bytes:
    """The checkpoint key of the data directory ``home`` (made the first time)."""
    path = key_file(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if path.exists():
        key = path.read_bytes()
        if len(key) != KEY_BYTES:
            raise SealError(f"{path}: not a {KEY_BYTES}-byte key")
        return key
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def install(key: bytes | None) -> None:
    """Seal the checkpoints this process writes with ``key`` (None: write them plain)."""
    global _key
    if key is not None and len(key) != KEY_BYTES:
        raise SealError(f"a checkpoint key has {KEY_BYTES} bytes, not {len(key)}")
    _key = key


def current() -> bytes | None:
    return _key


def sealed(head: bytes) -> bool:
    """Whether a file starting with ``head`` is sealed."""
    return head.startswith(MAGIC)


def seal(data: bytes, part: str) -> bytes:
    """``data`` sealed with this process's key (which must be installed)."""
    if _key is None:
        raise SealError("no checkpoint key installed")
    nonce = os.urandom(NONCE_BYTES)
    return MAGIC + nonce + AESGCM(_key).encrypt(nonce, data, part.encode())


def unseal(blob: bytes, part: str, name: str) -> bytes:
    """The plain bytes of the sealed file ``name``; :class:`SealError` says why not."""
    if _key is None:
        raise SealError(
            f"{name} is encrypted (dmsc up --encrypt-checkpoints) and this process has no key"
        )
    nonce = blob[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
    try:
        return AESGCM(_key).decrypt(nonce, blob[len(MAGIC) + NONCE_BYTES :], part.encode())
    except InvalidTag:
        why = f"{name} cannot be decrypted: sealed with another key, or altered"
        raise SealError(why) from None
