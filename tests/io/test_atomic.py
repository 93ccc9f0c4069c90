"""Where an output may go: an existing output is refused with advice that works -- --overwrite is
offered only where it would be allowed, a file or a directory of the user's is named instead."""

import pytest

from featherweight.errors import OutputExistsError
from featherweight.io.atomic import OUTPUT_MARKER, check_output_dir, refuse_foreign_output


def test_an_existing_file_is_named_as_a_file_and_overwrite_is_not_offered(tmp_path):
    out = tmp_path / "merged"
    out.write_text("my notes")
    with pytest.raises(OutputExistsError) as error:
        check_output_dir(out, overwrite=False)
    assert f"{out} is a file" in str(error.value)
    assert "pass --overwrite" not in str(error.value)
    with pytest.raises(OutputExistsError, match="never replaces a file"):
        refuse_foreign_output(out)  # what --overwrite meets
    assert out.read_text() == "my notes"


def test_a_directory_of_your_files_is_named_and_overwrite_is_not_offered(tmp_path):
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError) as error:
        check_output_dir(out, overwrite=False)
    assert "holds 'notes.txt', which featherweight did not write" in str(error.value)
    assert "pass --overwrite" not in str(error.value)


def test_an_earlier_output_is_offered_to_overwrite(tmp_path):
    out = tmp_path / "adapter"
    out.mkdir()
    (out / OUTPUT_MARKER).write_text("")
    with pytest.raises(OutputExistsError, match="pass --overwrite to replace it"):
        check_output_dir(out, overwrite=False)
    assert check_output_dir(out, overwrite=True) == out
