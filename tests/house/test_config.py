"""Sizes, modes and the config precedence defaults < TOML file < flags, with one-line errors."""

import dataclasses

import pytest

from cachefs.cli import build_parser, config_from_args
from cachefs.config import MountConfig, build_config, parse_mode, parse_size
from cachefs.errors import ConfigError, ExitCode

URL = "s3://bucket/prefix"


def config(tmp_path, toml: str | None = None, *flags: str) -> MountConfig:
    """``cachefs mount URL MNT [--config FILE] FLAGS`` parsed into a MountConfig."""
    argv = ["mount", URL, str(tmp_path / "mnt")]
    if toml is not None:
        path = tmp_path / "cachefs.toml"
        path.write_text(toml)
        argv += ["--config", str(path)]
    return config_from_args(build_parser().parse_args([*argv, *flags]))


def config_error(tmp_path, toml: str | None = None, *flags: str) -> str:
    with pytest.raises(ConfigError) as info:
        config(tmp_path, toml, *flags)
    message = str(info.value)
    assert message and "\n" not in message
    assert info.value.exit_code == ExitCode.USAGE
    return message


# --- parse_size, parse_mode ---------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("100", 100), ("4k", 4096), ("4K", 4096), ("4KiB", 4096), ("4kb", 4096), ("512M", 512 << 20),
    ("50G", 50 << 30), ("1.5T", 3 << 39), (" 2 g ", 2 << 30), ("1P", 1 << 50), ("4Mi", 4 << 20),
    (123, 123), ("0.5K", 512),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "1.5.5", "-1", "1e9", "5X", "M", "4 M B", True, "1,000"])
def test_parse_size_rejects_with_the_option_name(text):
    with pytest.raises(ConfigError) as info:
        parse_size(text, "cache_size")
    assert str(info.value).startswith("cache_size: expected a size")


def test_negative_sizes_are_rejected(tmp_path):
    with pytest.raises(ConfigError):
        parse_size(-1, "readahead_size")
    config_error(tmp_path, "readahead_size = -1\n")


@pytest.mark.parametrize("value, expected", [("0644", 0o644), ("755", 0o755), ("0", 0), (0o640, 0o640),
                                             ("0o600", 0o600), ("7777", 0o7777)])
def test_parse_mode(value, expected):
    assert parse_mode(value, "file_mode") == expected


@pytest.mark.parametrize("value", ["rw-r--r--", "0999", "", "u+x", True, "64 4"])
def test_parse_mode_rejects_with_the_option_name(value):
    with pytest.raises(ConfigError) as info:
        parse_mode(value, "file_mode")
    assert str(info.value).startswith("file_mode: expected an octal mode")


@pytest.mark.parametrize("digits", [644, 400])
def test_a_toml_integer_mode_means_the_same_as_the_flag_or_is_refused(tmp_path, digits):
    flag = config(tmp_path, None, "--file-mode", str(digits)).file_mode
    try:
        toml = config(tmp_path, f"file_mode = {digits}\n").file_mode
    except ConfigError:
        return
    assert toml == flag == int(str(digits), 8)


# --- precedence ----------------------------------------------------------------------------------

def test_defaults_without_a_file_or_flags(tmp_path):
    cfg = config(tmp_path)
    defaults = MountConfig(url=URL, mountpoint=str(tmp_path / "mnt"))
    assert dataclasses.asdict(cfg) == dataclasses.asdict(defaults)
    assert (cfg.url, cfg.mountpoint, cfg.block_size, cfg.immutable) == (URL, str(tmp_path / "mnt"), None, False)
    assert (cfg.block_size_for(packed=False), cfg.block_size_for(packed=True)) == (4 << 20, 8 << 20)
    small = config(tmp_path, None, "--mem-cache-size", "12M")    # two 8 MiB blocks do not fit: 4 MiB ones
    assert (small.block_size_for(packed=True), config(tmp_path, None, "--block-size", "1M").block_size_for(True)) \
        == (4 << 20, 1 << 20)


def test_flags_override_the_toml_file_which_overrides_defaults(tmp_path):
    toml = """
        cache_size = "1G"
        block-size = "128K"
        immutable = true
        metadata_ttl = 5
        file_mode = "0600"
        max_fetches = 7
        endpoint_url = "http://toml:9000"
    """
    cfg = config(tmp_path, toml, "--cache-size", "2G", "--no-immutable", "--max-fetches", "9",
                 "--dir-mode", "0700", "--cache-dir", str(tmp_path / "c"))
    assert cfg.cache_size == 2 << 30                     # flag over TOML
    assert cfg.immutable is False
    assert cfg.max_fetches == 9
    assert cfg.block_size == 128 << 10                   # TOML (dashed key) over default
    assert cfg.metadata_ttl == 5.0 and isinstance(cfg.metadata_ttl, float)
    assert cfg.file_mode == 0o600 and cfg.dir_mode == 0o700
    assert cfg.endpoint_url == "http://toml:9000"
    assert cfg.cache_dir == str(tmp_path / "c")
    assert cfg.max_prefetches == 8                       # default


def test_bool_flags_and_string_bools(tmp_path):
    assert config(tmp_path, None, "--immutable").immutable is True
    assert config(tmp_path, 'immutable = "yes"\nallow_other = "off"\n').immutable is True
    assert config(tmp_path, "immutable = true\n", "--no-immutable").immutable is False


def test_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config_from_args(build_parser().parse_args(["mount", URL, "mnt", "--cache-dir", "cache"]))
    assert cfg.mountpoint == str(tmp_path / "mnt") and cfg.cache_dir == str(tmp_path / "cache")


# --- errors: one line, exit code 2 ---------------------------------------------------------------

def test_unknown_toml_key(tmp_path):
    assert config_error(tmp_path, "cache_size = '1G'\nbogus_option = 1\nzeta = 2\n") == \
        "unknown option(s): bogus_option, zeta"


def test_unknown_key_with_a_newline_is_shown_on_one_line(tmp_path):
    assert config_error(tmp_path, '"a\\nb" = 1\n"' + "x" * 100 + '" = 2\n') == \
        "unknown option(s): 'a\\nb', " + "x" * 77 + "..."


@pytest.mark.parametrize("toml, words", [
    ('metadata_ttl = "soon"', ["metadata_ttl", "float", "'soon'"]),
    ('immutable = "maybe"', ["immutable", "bool"]),
    ("max_fetches = 1.5", ["max_fetches", "int", "1.5"]),
    ("max_fetches = true", ["max_fetches", "int"]),
    ("endpoint_url = 5", ["endpoint_url", "str", "5"]),
    ("cache_size = [1, 2]", ["cache_size", "size"]),
    ('file_mode = "rw"', ["file_mode", "octal"]),
    ("metadata_ttl = false", ["metadata_ttl", "float"]),
])
def test_wrong_types_in_toml(tmp_path, toml, words):
    message = config_error(tmp_path, toml + "\n")
    for word in words:
        assert word in message


@pytest.mark.parametrize("flags, words", [
    (["--cache-size", "lots"], ["cache_size", "'lots'"]),
    (["--max-fetches", "many"], ["max_fetches", "int"]),
    (["--block-size", "65K"], ["block_size", "multiple of 4K"]),
    (["--mem-cache-size", "1M"], ["mem_cache_size", "two blocks"]),
    (["--max-prefetches", "0"], ["max_prefetches", ">= 1"]),
    (["--free-space-ratio", "1"], ["free_space_ratio"]),
    (["--log-level", "loud"], ["log_level"]),
    (["--metrics-port", "70000"], ["metrics_port"]),
    (["--dir-mode", "17777"], ["modes"]),
    (["--fuse-no-open"], ["--fuse-no-open", "--immutable"]),
    (["--fuse-idle-backings", "-1"], ["fuse_idle_backings", "0..4194304"]),
    (["--fuse-idle-backings", "5000000"], ["fuse_idle_backings"]),
    (["--fuse-poll-us", "5000"], ["fuse_poll_us", "0..1000"]),
    (["--fuse-poll-us", "-1"], ["fuse_poll_us"]),
    (["--fuse-no-open", "--read-only"], ["--fuse-no-open", "--immutable"]),
    (["--fuse-no-open", "--immutable", "--fuse-backend", "pyfuse3"], ["--fuse-no-open", "cachefs"]),
])
def test_bad_flag_values(tmp_path, flags, words):
    message = config_error(tmp_path, None, *flags)
    for word in words:
        assert word in message


@pytest.mark.parametrize("toml", ["cache_size = ", "[section\n", "a = 1\na = 2\n", "x = 'unterminated\n",
                                  "\x00"])
def test_malformed_toml(tmp_path, toml):
    message = config_error(tmp_path, toml)
    assert message.startswith(f"config file {tmp_path / 'cachefs.toml'}: not valid TOML")


def test_missing_or_unreadable_config_file(tmp_path):
    argv = ["mount", URL, str(tmp_path / "mnt"), "--config"]
    with pytest.raises(ConfigError, match="not found"):
        config_from_args(build_parser().parse_args([*argv, str(tmp_path / "absent.toml")]))
    with pytest.raises(ConfigError) as info:
        config_from_args(build_parser().parse_args([*argv, str(tmp_path)]))   # a directory
    assert "\n" not in str(info.value)


def test_build_config_needs_url_and_mountpoint():
    with pytest.raises(ConfigError, match="missing url"):
        build_config({"mountpoint": "/mnt"})
    with pytest.raises(ConfigError, match="missing mountpoint"):
        build_config({"url": URL, "mountpoint": ""})


def test_config_file_that_is_not_utf8_is_one_line(tmp_path):
    """Found by tests/house/test_fuzz_inputs.py: tomllib's UnicodeDecodeError escaped as a traceback."""
    path = tmp_path / "bad.toml"
    path.write_bytes(b"cache_size = \"\x80\"")
    with pytest.raises(ConfigError) as info:
        config_from_args(build_parser().parse_args(["mount", URL, str(tmp_path / "m"), "--config", str(path)]))
    assert "not UTF-8" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("toml", ["read_timeout = inf", "metadata_ttl = nan", "checkpoint_sync_period = -inf"])
def test_nonfinite_floats_in_toml_are_refused(tmp_path, toml):
    assert "expected float" in config_error(tmp_path, toml)
