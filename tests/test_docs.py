"""The README stays true to the code: its set-up commands exist, every option and exit code is listed."""

import re
from pathlib import Path

from cachefs.config import option_fields, options_table
from cachefs.errors import ExitCode

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_setup_commands():
    first_block = re.search(r"```sh\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci/run").read_text()


def test_every_mount_option_is_documented():
    missing = [f.name for f in option_fields() if f"`{f.name}`" not in README]
    assert not missing, f"options missing from README: {missing}"
    block = re.search(r"<!-- options:begin[^>]*-->\n(.*?)\n<!-- options:end -->", README, re.S).group(1)
    assert block == options_table(), "README option table is stale: paste `python -m cachefs.config`"


def test_every_exit_code_is_documented():
    codes = {v for k, v in vars(ExitCode).items() if k.isupper()}
    table = re.findall(r"^\| (\d+) \|", README, re.M)
    assert codes == {int(c) for c in table}
