"""``store.keys``: the master keys that open an encrypted store.

:class:`Keys` is the namespace of :class:`casckpt.Store` for its master keys (list, add,
remove, rotate); the key record and its wrapping live in :mod:`casckpt.engine.maintenance.keyring`.
No call rewrites data: only the key record changes, in the catalog and on every location.
"""

from __future__ import annotations

import os

from casckpt.engine.maintenance import keyring
from casckpt.errors import InvalidArgumentError
from casckpt.store_core import StoreCore
from casckpt.types import KeyInfo

_NEEDS = "the catalog and the locations (the key record)"


class Keys:
    """The master keys of one open store (``store.keys``); thread-safe as the store is."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def list(self) -> list[KeyInfo]:
        """The master keys of an encrypted store: each key's public id, when and by whom it
        was added, and whether this handle was opened with it (never the keys themselves).

        Raises:
            NotEncryptedError: the store is not encrypted.
        """
        core = self._core
        return [KeyInfo(s.id, s.created_at, s.created_by, s.id == core.crypto.opened_with)
                for s in keyring.key_slots(core.catalog)]

    def add(self, key_file: str | os.PathLike[str]) -> KeyInfo:
        """Let the master key in ``key_file`` open this encrypted store too.

        The store's data key is wrapped under the new key and the key record rewritten
        (in the catalog and on every location); no data is rewritten. Make a key file with
        :func:`casckpt.generate_key_file` (`casckpt key generate FILE`).

        Raises:
            NotEncryptedError: the store is not encrypted.
            StoreKeyError: ``key_file`` is not a key file.
            InvalidArgumentError: the key is one of the store's already.
        """
        core = self._core
        self._core.refuse_while_recovering("add a key")
        self._core.refuse_write("store.keys.add", _NEEDS)
        slot = keyring.add_key(core.catalog, core.locations, core.crypto, keyring.read_key_file(key_file))
        return KeyInfo(slot.id, slot.created_at, slot.created_by, False)

    def remove(self, key_id: str) -> None:
        """Remove master key ``key_id`` (see :meth:`list`): it no longer opens the store.

        A copy of the key record taken before (a backup of the catalog or a location)
        still opens with the removed key: rotate keys you believe stolen *and* treat old
        backups of the catalog and the ``casckpt-keys`` objects as holding the old key.

        Raises:
            LastKeyError: it is the store's only key (nothing would open the store).
            InvalidArgumentError: the store has no key of that id.
        """
        core = self._core
        self._core.refuse_while_recovering("remove a key")
        self._core.refuse_write("store.keys.remove", _NEEDS)
        keyring.remove_key(core.catalog, core.locations, key_id)

    def rotate(self, new_key_file: str | os.PathLike[str], old: str | None = None) -> KeyInfo:
        """Replace master key ``old`` (default: the one this handle was opened with) by the
        key in ``new_key_file``, in one change of the key record; no data is rewritten.

        Raises:
            NotEncryptedError: the store is not encrypted.
            InvalidArgumentError: ``old`` is not one of its keys, or the new key is already.
        """
        core = self._core
        self._core.refuse_while_recovering("rotate a key")
        self._core.refuse_write("store.keys.rotate", _NEEDS)
        replaced = old or core.crypto.opened_with
        if replaced is None:
            keyring.key_slots(core.catalog)  # raises NotEncryptedError
            raise InvalidArgumentError("name the key to replace (old=KEY_ID)")
        slot = keyring.rotate_key(core.catalog, core.locations, core.crypto, replaced,
                                  keyring.read_key_file(new_key_file))
        return KeyInfo(slot.id, slot.created_at, slot.created_by, False)
