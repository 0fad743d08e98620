"""The exceptions flatshard raises on purpose, beside Python's own (``ValueError`` for a bad
argument, ``FileExistsError`` for a destination it will not touch, ...).

Every one is an ``Exception``, so ``except Exception`` sees it, and names what is wrong: the
file, the param, the rank.

The reasoning is [Note: never silent] below."""

# [Note: never silent]
#
# A result that is wrong without saying so costs a user more than any error. The rules, and
# where each is enforced:
#
# * **A save is whole or refused.** One save at a time per path (rank 0 holds ``PATH.lock``),
#   every rank naming the same path; the save's id in the manifest and bound into every item's
#   checksum, so a file of another save or swapped files fail as corrupted ones do; a load
#   checks every rank opened the same save; per-rank ``extra`` values come back to their own
#   rank or, at another world size, are an error naming the key ([Note: checkpoints] and
#   [Note: checkpoint checksums] in ``checkpoint/``). Nothing a save did not write is deleted
#   or overwritten ([Note: save destinations] in ``checkpoint/destination.py``).
# * **Ranks agree or say so.** At wrap time, the model and every option that shapes the
#   collectives (the plan's lines, ``wrap/plan.py``, checked before anything is built); the
#   optimizer's param groups and hyperparameters at construction, at every step that
#   all-reduces the grad norm (a digest riding on it), else every ``CHECK_EVERY`` steps, and
#   at every save (``optim/agreement.py``). A disagreement is a
#   ``ValueError`` on every rank naming the setting, the rank and both values.
# * **Arguments are checked as torch checks its own**: ``clip_grad_norm_`` refuses a NaN or
#   negative ``max_norm`` and, with ``error_if_nonfinite``, a non-finite norm
#   (``optim/distributed.py``).
# * **A placeholder never computes.** A module shared by two units belongs to their common
#   ancestor unit (``units/unit_tree.py``), so whichever block runs, its params are full. A param
#   read *outside* its unit's forward is a ``Placeholder`` that refuses any operation on its
#   values with a ``ShardedParamError`` naming the param and its unit ([Note: placeholders] in
#   ``units/placeholder.py``).
# * **A grad is whole or refused.** Where flatshard holds a param's grad in its buffers, its
#   ``.grad`` is a ``ShardedGrad``: torch's norms and clipping on it are global, any other use
#   is a ``ShardedGradError``, and a ``.grad`` assigned by hand is refused at the step
#   ([Note: grads seen by torch] in ``engine/grad_view.py``).
# * **A non-finite step is refused or says why.** With a loss scaler a skip is fp16 overflow
#   handling; without one a step on inf or NaN grads raises a ``NonFiniteGradError`` naming
#   the params (``nonfinite="skip"``: a skip with a ``RuntimeWarning`` naming them)
#   (``optim/distributed.py``).
# * **Changes after wrapping are named** at the next forward (``wrap/changes.py``); ranks
#   start from rank 0's params and buffers and take rank 0's buffers before each forward, as
#   DDP does (``sync_module_states``, ``broadcast_buffers``).
# * **Every collective flatshard issues has a deadline** ([Note: deadlines] in
#   ``comm/deadline.py``): a rank that stops is a ``DesyncError``, never a hang. Those
#   ``torch.distributed.checkpoint`` issues inside a save or load run on a gloo group whose
#   timeout is the same deadline (``comm.world.timed_group``), and fail as a ``DesyncError``.

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint or weights file cannot be read as written: missing or cut-short files, an
    unknown format, a manifest that is not JSON, or a save or load that failed on some rank
    (the message names each rank and its cause)."""


class ChecksumError(CheckpointError):
    """Bytes read back from a checkpoint or weights file differ from the bytes written: the
    message names the file and the tensor (or param) whose checksum does not match."""


class ShardedParamError(RuntimeError):
    """A stage-3 param's values were read while they are sharded: outside the forward and
    backward of the unit that holds it and outside ``summon_full_params``; or any param of a
    flat buffer read while ``offload_states`` holds its bytes on the host; or a param that holds
    its fp8 value between steps (``MixedPrecision(fp8_gathers=True)`` at stages 1-2) written in place.
    The message names the param, its unit and the operation ([Note: placeholders] in
    ``units/placeholder.py``)."""


class ShardedGradError(RuntimeError):
    """A param's ``.grad`` that flatshard holds in its buffers (sharded across ranks, or in
    fp32 ``main_grad``) was used in a way that has no answer on one rank, or was assigned by
    hand where no reduction would see it. The message names the param, the operation and
    what to call instead ([Note: grads seen by torch] in ``engine/grad_view.py``)."""


class NonFiniteGradError(FloatingPointError):
    """A step's grads hold inf or NaN on some rank and no loss scaler expects overflows: the
    message names the params with non-finite grads on this rank; nothing was stepped
    (``DistributedOptimizer(nonfinite=...)`` in ``optim/distributed.py``)."""


class DesyncError(RuntimeError):
    """A collective flatshard issued did not complete within its deadline (``shard(timeout=
    ...)``), or failed because a peer stopped: the ranks are not at the same collective. The
    message names every rank's step, phase and last collective ([Note: deadlines] in
    ``comm/deadline.py``)."""
