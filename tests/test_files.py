"""Files written whole or not at all (mlx_dflash.files)."""

import mlx.core as mx
import pytest

from mlx_dflash.files import write_text, written_whole


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "results.json"
    write_text(path, "old")
    with pytest.raises(KeyboardInterrupt):
        with written_whole(path) as tmp:
            tmp.write_text("half of the ne")
            raise KeyboardInterrupt  # a Ctrl-C while writing
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_writers_get_names_of_their_own_with_the_format_suffix(tmp_path):
    path = tmp_path / "cache.bin"
    with written_whole(path, suffix=".safetensors") as a, written_whole(path, suffix=".safetensors") as b:
        assert a != b and a.parent == b.parent == tmp_path
        # MLX appends .safetensors to a name without it: the temporary name must have it already.
        mx.save_safetensors(str(a), {"x": mx.arange(3)})
        mx.save_safetensors(str(b), {"x": mx.arange(4)})
    assert mx.load(str(path), format="safetensors")["x"].tolist() == [
        0,
        1,
        2,
    ]  # the outer block ends last: its rename wins
    assert [p.name for p in tmp_path.iterdir()] == ["cache.bin"]


def test_a_scratch_folder_keeps_the_half_written_file_out_of_the_target_folder(tmp_path):
    scratch = tmp_path / ".partial"
    scratch.mkdir()
    with written_whole(tmp_path / "model.safetensors", scratch=scratch) as tmp:
        assert tmp.parent == scratch and tmp.suffix == ".safetensors"
        mx.save_safetensors(str(tmp), {"w": mx.ones(2)})
        assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == []
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]


def test_a_name_the_file_system_takes_gets_a_temporary_name_it_takes(tmp_path):
    """The temporary name adds about 30 bytes: a 240-byte name failed with
    "File name too long", after the work, naming the temporary file."""
    path = tmp_path / ("a" * 228 + ".safetensors")
    with written_whole(path) as tmp:
        assert len(tmp.name.encode()) <= 255 and tmp.suffix == ".safetensors"
        mx.save_safetensors(str(tmp), {"x": mx.arange(2)})
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
