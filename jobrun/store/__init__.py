"""The checkpoint store: crash-safe, verifiable saves of a workspace per node, epoch and rank.

    files       one rank's directory: its layout; prepare, write (atomic), save
    read        one rank's directory: checked, verified (verify_dir), loaded (load)
    catalog     a checkpoint directory's epochs: list, verify, latest complete, prune, upload
    tensorfile  the tensors file, through the safetensors library, and its CRC-32 checksums
    codec       a workspace <-> JSON values + tensors, without pickle

An asynchronous save is ``prepare(copy=True)`` on the training thread and ``write`` on
another (see runner/job.py): the same write as a synchronous ``save``.
"""

from jobrun.store.catalog import (
    EpochInfo,
    NodeInfo,
    clean,
    complete_epochs,
    delete_epochs,
    in_the_way,
    intact_epochs,
    latest_complete_epoch,
    list_checkpoints,
    prunable,
    prune,
    saved_by,
    saved_world_size,
    upload,
    verify,
)
from jobrun.store.codec import SavedState, UnsupportedValue, restore
from jobrun.store.files import (
    FORMAT,
    FORMAT_VERSION,
    Prepared,
    SaveResult,
    epoch_dir,
    prepare,
    rank_dir,
    save,
    write,
)
from jobrun.store.read import load, load_dir, read_manifest, verify_dir

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "EpochInfo",
    "NodeInfo",
    "Prepared",
    "SaveResult",
    "SavedState",
    "UnsupportedValue",
    "clean",
    "complete_epochs",
    "delete_epochs",
    "epoch_dir",
    "in_the_way",
    "intact_epochs",
    "latest_complete_epoch",
    "list_checkpoints",
    "load",
    "load_dir",
    "prepare",
    "prunable",
    "prune",
    "rank_dir",
    "read_manifest",
    "restore",
    "save",
    "saved_by",
    "saved_world_size",
    "upload",
    "verify",
    "verify_dir",
    "write",
]
