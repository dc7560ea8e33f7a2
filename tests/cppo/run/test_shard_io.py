"""Reading FSDP2 shards (torch.distributed.checkpoint) without running code: the metadata through an allowlist, the
entries with weights_only first; a missing or torn metadata file is a corrupt checkpoint."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiny_run import Exploit, ran, raw_exploit

from cppo.run import CorruptCheckpoint, UnsafeCheckpoint
from cppo.run.shard_io import ALLOWED_GLOBALS, load_shards, read_metadata


def test_fsdp2_shard_metadata_and_entries_are_read_without_running_code(tmp_path):
    marker = tmp_path / "code-ran"
    saved = {"w": torch.randn(3, 2), "param_groups": [{"lr": 0.5, "betas": (0.9, 0.99)}]}
    dcp.save(saved, checkpoint_id=str(tmp_path / "good"))
    target = {"w": torch.zeros(3, 2), "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}
    load_shards(target, str(tmp_path / "good"))
    assert torch.equal(target["w"], saved["w"]) and target["param_groups"] == saved["param_groups"]

    dcp.save({"w": torch.randn(3, 2), "evil": Exploit(marker)}, checkpoint_id=str(tmp_path / "entry"))
    with pytest.raises(UnsafeCheckpoint, match="evil"):
        load_shards({"w": torch.zeros(3, 2), "evil": None}, str(tmp_path / "entry"))
    (tmp_path / "good" / ".metadata").write_bytes(raw_exploit(marker))
    with pytest.raises(UnsafeCheckpoint, match=".metadata"):
        read_metadata(str(tmp_path / "good"))
    assert not ran(marker)


def test_metadata_reads_as_dcp_wrote_it(tmp_path):
    dcp.save({"w": torch.randn(4, 2, dtype=torch.bfloat16)}, checkpoint_id=str(tmp_path))
    meta = read_metadata(str(tmp_path))
    assert meta.state_dict_metadata["w"].size == torch.Size([4, 2])
    assert meta.state_dict_metadata["w"].properties.dtype == torch.bfloat16  # a dtype: resolved, not a global
    assert ("torch", "Size") in ALLOWED_GLOBALS


def test_a_missing_or_torn_metadata_file_is_a_corrupt_checkpoint(tmp_path):
    with pytest.raises(CorruptCheckpoint, match=r"\.metadata' cannot be read \(FileNotFoundError"):
        read_metadata(str(tmp_path))
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path))
    data = (tmp_path / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpoint, match=r"\.metadata' cannot be read"):
        read_metadata(str(tmp_path))


def test_shards_of_another_shape_do_not_load(tmp_path):
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path))
    with pytest.raises(CorruptCheckpoint, match="cannot be read"):
        load_shards({"w": torch.zeros(5)}, str(tmp_path))
