"""Checksums: every byte of a checkpoint's data files and of an exported weights file is
covered by a checksum written with it, so a flipped byte is an error naming the file and
the tensor (it used to load silently: 15 of 40 flips gave wrong params or optimizer state);
checkpoints written before checksums still load; ``flatshard verify`` checks without loading."""

import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

import flatshard
from _checkpoints import ADAMW, build, load_step_case, save_case
from _cli import cli
from _parity import TiedGPT
from flatshard import CheckpointError, ChecksumError, export_checkpoint, load_weights, verify_checkpoint
from flatshard.checkpoint import pieces
from flatshard.checkpoint.pieces import Crc32Trailer
from flatshard.toolkit.testing import run_distributed


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def _load_error(path: str) -> str:
    model, opt, _ = build(2, ADAMW)
    try:
        flatshard.load_checkpoint(path, model, opt)
    except ChecksumError as e:
        return str(e)
    return "loaded"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("saved") / "ckpt")
    run_distributed(save_case, 2, path, 2, ADAMW)
    return path


def test_every_flipped_byte_of_a_data_file_is_named_on_every_rank(saved, tmp_path):
    data = sorted(n for n in os.listdir(saved) if n.endswith(".distcp"))
    assert len(data) == 2
    for name in data:
        size = os.path.getsize(os.path.join(saved, name))
        for at in range(0, size, size // 6 + 1):  # 6 places spread over the file, headers included
            copy = str(tmp_path / f"flip-{name}-{at}")
            shutil.copytree(saved, copy)
            _flip(os.path.join(copy, name), at)
            errors = run_distributed(_load_error, 2, copy)
            assert all(f"{copy}/{name}" in e and "does not match the checksum" in e for e in errors), (
                at,
                errors,
            )
            with pytest.raises(ChecksumError, match=name):
                verify_checkpoint(copy)


def test_the_index_and_the_manifest_are_checked_too(saved, tmp_path):
    copy = str(tmp_path / "index")
    shutil.copytree(saved, copy)
    _flip(os.path.join(copy, ".metadata"), os.path.getsize(os.path.join(copy, ".metadata")) // 2)
    with pytest.raises(ChecksumError, match=r"\.metadata does not match its checksum"):
        load_step_case(copy)
    with open(os.path.join(copy, "flatshard.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=r"flatshard\.json is not JSON"):
        load_step_case(copy)


def test_verify_counts_what_it_checked_and_the_cli_exits_1_on_a_bad_file(saved, tmp_path):
    counts = verify_checkpoint(saved)
    assert counts["checked"] > 50 and counts["unchecked"] == 0
    good = cli("verify", saved)
    assert good.returncode == 0 and "match their checksums" in good.stdout
    copy = str(tmp_path / "bad")
    shutil.copytree(saved, copy)
    name = next(n for n in os.listdir(copy) if n.endswith(".distcp"))
    _flip(os.path.join(copy, name), 700)
    bad = cli("verify", copy)
    assert bad.returncode == 1 and f"{copy}/{name}" in bad.stderr


@pytest.mark.parametrize("trailers", [(), (Crc32Trailer(),)], ids=["none", "unbound"])
def test_a_checkpoint_of_an_older_flatshard_still_loads(tmp_path, monkeypatch, trailers):
    """Checkpoints written before checksums carry none, and those written before checksums
    were bound to their save carry unbound ones: both load as before."""
    monkeypatch.setattr(pieces, "_BindingTransforms", lambda save_id: _StorageWriterTransforms(trailers))
    path = str(tmp_path / "old")
    save_case(path, 1, ADAMW)
    monkeypatch.undo()
    counts = verify_checkpoint(path)
    assert (counts["checked"] > 100, counts["unchecked"] == 0) == (bool(trailers), bool(trailers))
    assert load_step_case(path) == 3


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_flipped_byte_in_an_exported_file_is_named_when_it_is_read(saved, tmp_path, suffix):
    out = str(tmp_path / f"model{suffix}")
    export_checkpoint(saved, out)
    assert verify_checkpoint(out)["checked"] > 10
    load_weights(TiedGPT(), out)  # as written: loads
    _flip(out, os.path.getsize(out) // 2)
    with pytest.raises(ChecksumError, match=f"{out}.* does not match"):
        load_weights(TiedGPT(), out)
    with pytest.raises(ChecksumError, match=f"{out}.* does not match"):
        verify_checkpoint(out)


def test_a_rank_reading_part_of_a_tensor_checks_the_blocks_it_reads(tmp_path):
    """A .safetensors read of a range checks the whole checksum blocks it touches, so stage 3
    ranks that read only their shards still check everything they read."""
    from flatshard.checkpoint import files as sf

    out = str(tmp_path / "big.safetensors")
    big = torch.arange(3 * sf.CRC_BLOCK // 4, dtype=torch.float32)  # 3 blocks of 1 MiB
    entries = [sf.Entry("w", tuple(big.shape), big.dtype, "w")]
    sf.write_state_file(out, entries, lambda es: iter([(es[0], big)]))
    src = sf.open_source(out)
    assert len(src.checksums["w"]) == 3
    assert torch.equal(src.read("w", 10, sf.CRC_BLOCK // 4 + 5), big[10 : sf.CRC_BLOCK // 4 + 5])
    header = os.path.getsize(out) - big.numel() * 4
    _flip(out, header + 2 * sf.CRC_BLOCK + 8)  # in the third block
    assert torch.equal(src.read("w", 0, 100), big[:100])  # the first block is intact
    with pytest.raises(ChecksumError, match=r"'w' \(bytes 2097152\.\.3145728 of the tensor\)"):
        src.read("w", big.numel() - 3, big.numel())


def test_random_bytes_as_weights_are_refused_naming_the_file(tmp_path):
    for suffix in (".safetensors", ".pt"):
        junk = str(tmp_path / f"junk{suffix}")
        with open(junk, "wb") as f:
            f.write(os.urandom(4096))
        with pytest.raises(CheckpointError, match=f"{junk}"):
            load_weights(TiedGPT(), junk)
