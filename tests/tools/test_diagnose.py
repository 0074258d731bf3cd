"""`agentwin diagnose` input errors are clear and exit 2 before any model loads."""

from tools import cli


def test_missing_and_empty_files_are_clear_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    b = tmp_path / "b.txt"
    b.write_text("Later she told him.")
    assert cli.main(["diagnose", "--a-file", str(tmp_path / "nope.txt"), "--b-file", str(b), "--question", "Who?"]) == 2
    assert "cannot read chunk A" in capsys.readouterr().err
    assert cli.main(["diagnose", "--a-file", str(empty), "--b-file", str(b), "--question", "Who?"]) == 2
    assert "is empty" in capsys.readouterr().err


def test_case_and_files_are_one_or_the_other(tmp_path, capsys):
    b = tmp_path / "b.txt"
    b.write_text("Later she told him.")
    assert cli.main(["diagnose", "--case", "nope"]) == 2
    assert "unknown hard case" in capsys.readouterr().err
    assert cli.main(["diagnose", "--case", "code", "--b-file", str(b)]) == 2
    assert "--case replaces" in capsys.readouterr().err
    assert cli.main(["diagnose", "--b-file", str(b), "--question", "Who?"]) == 2
    assert "give --a-file" in capsys.readouterr().err
