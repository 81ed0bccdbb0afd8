"""The `loraplex` command line, called in-process through main(argv): the contract of each
command, its output, and one-line errors with a non-zero exit."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest

from loraplex.cli import main
from loraplex.registry import Registry, RegistryConfig
from tests.registry.registry_support import (
    MAX_RANK,
    MODEL_ID,
    TINY,
    adapter_tensors,
    write_adapter,
)

KEY = re.compile(r"lpx-[A-Za-z0-9_-]{43}")


@pytest.fixture
def cli(registry_config: RegistryConfig, capsys: pytest.CaptureFixture[str]):
    """Run `loraplex ARGS` against the test registry; returns (exit code, stdout, stderr)."""
    options = ["--data-dir", str(registry_config.data_dir),
               "--database-url", registry_config.url]

    def run(*args: str) -> tuple[int, str, str]:
        code = main([*args, *options])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _fails_with(result: tuple[int, str, str], reason: str) -> None:
    code, out, err = result
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("loraplex: error: "), err
    assert reason in err, err


def _record_served_model(config: RegistryConfig) -> None:
    with Registry.open(config) as registry:
        registry.models.set(MODEL_ID, TINY, MAX_RANK)


def test_db_upgrade_is_idempotent(cli) -> None:
    for _ in range(2):
        code, out, err = cli("db", "upgrade")
        assert (code, err) == (0, "")
        assert out.startswith("registry schema at revision 0005 (")


def test_tenants(cli) -> None:
    assert cli("tenant", "create", "acme")[:2] == (0, "created tenant acme (weight 1)\n")
    assert cli("tenant", "create", "beta", "--weight", "2.5")[0] == 0
    code, out, _ = cli("tenant", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:2] == ["NAME", "WEIGHT"]
    assert [line.split()[:2] for line in lines[1:]] == [["acme", "1"], ["beta", "2.5"]]
    _fails_with(cli("tenant", "create", "acme"), "tenant 'acme' already exists")
    _fails_with(cli("tenant", "create", "no/slash"), "invalid tenant name 'no/slash'")
    _fails_with(cli("tenant", "create", "x", "--weight", "0"), "weight must be")
    # A weight of 1e-300 would blow its tenant's service counter past float precision.
    _fails_with(cli("tenant", "create", "x", "--weight", "1e-300"),
                "weight must be a number from 0.001 to 1000")


def test_tenant_set_changes_weight_and_limits(cli, registry_config: RegistryConfig) -> None:
    cli("tenant", "create", "acme", "--weight", "2")
    code, out, _ = cli("tenant", "set", "acme", "--weight", "4", "--max-concurrent-requests", "8")
    assert code == 0 and out.startswith("tenant acme: weight 4, max_concurrent_requests 8,")
    code, out, _ = cli("tenant", "set", "acme", "--max-concurrent-requests", "none")
    assert code == 0 and "weight 4, max_concurrent_requests unlimited" in out
    with Registry.open(registry_config) as registry:
        tenant = registry.tenants.get("acme")
    assert (tenant.weight, tenant.max_concurrent_requests) == (4.0, None)
    _fails_with(cli("tenant", "set", "acme"), "give --weight or a limit to change")
    _fails_with(cli("tenant", "set", "acme", "--weight", "-1"), "weight must be")
    _fails_with(cli("tenant", "set", "nobody", "--weight", "2"), "nobody")


def test_keys(cli, registry_config: RegistryConfig) -> None:
    cli("tenant", "create", "acme")
    code, out, err = cli("key", "create", "--tenant", "acme")
    assert (code, err) == (0, "") and KEY.fullmatch(out.rstrip("\n")) and out.count("\n") == 1
    secret = out.strip()
    code, admin_out, _ = cli("key", "create", "--admin")
    assert code == 0 and KEY.fullmatch(admin_out.strip())
    code, listing, _ = cli("key", "list")
    assert secret not in listing and secret[:12] + "..." in listing
    *table, note = listing.splitlines()
    assert note == ("(LAST_USED is recorded at most once every 60 s per key: it can be up to that much "
                    "behind.)")
    rows = [line.split() for line in table[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("1", "tenant", "acme"), ("2", "admin", "-")]
    assert cli("key", "revoke", "1")[:2] == (0, f"revoked key 1 ({secret[:12]}...)\n")
    with Registry.open(registry_config) as registry:
        assert registry.keys.list()[0].is_revoked
    _fails_with(cli("key", "revoke", "42"), "API key 42 does not exist")
    _fails_with(cli("key", "create", "--tenant", "nobody"), "tenant 'nobody' does not exist")


def test_usage_errors_are_one_line_with_exit_2(cli, capsys) -> None:
    for args in (["key", "create"], ["key", "create", "--admin", "--tenant", "x"],
                 ["key", "revoke", "abc"], ["serve", "--device", "tpu"], ["tenant"], ["nope"]):
        with pytest.raises(SystemExit) as caught:
            cli(*args)
        _, err = capsys.readouterr()
        assert caught.value.code == 2
        assert err.count("\n") == 1 and "error:" in err and "see --help" in err, err


def test_adapters(cli, registry_config: RegistryConfig, tmp_path: Path) -> None:
    cli("tenant", "create", "acme")
    folder = write_adapter(tmp_path / "adapter")
    _fails_with(cli("adapter", "upload", "--tenant", "acme", "--name", "sql", str(folder)),
                "no --model DIR was given")
    _record_served_model(registry_config)
    code, out, err = cli("adapter", "upload", "--tenant", "acme", "--name", "sql", str(folder))
    assert (code, err) == (0, "") and out.startswith("uploaded adapter sql for tenant acme: lora rank 4")
    _fails_with(cli("adapter", "upload", "--tenant", "acme", "--name", "sql", str(folder)),
                "already has an adapter named 'sql'")
    bad = write_adapter(tmp_path / "bad", tensors=adapter_tensors(rank=16),
                        config={"peft_type": "LORA", "r": 16, "lora_alpha": 16,
                                "target_modules": ["q_proj", "v_proj"]})
    _fails_with(cli("adapter", "upload", "--tenant", "acme", "--name", "big", str(bad)),
                "exceeds the limit of 8")
    deep = write_adapter(tmp_path / "deep")
    (deep / "adapter_config.json").write_bytes(b"[" * 30000 + b"]" * 30000)
    _fails_with(cli("adapter", "upload", "--tenant", "acme", "--name", "deep", str(deep)),
                "adapter_config.json is not valid JSON: it is nested deeper than 16 levels")
    code, out, _ = cli("adapter", "list")
    assert [line.split()[:3] for line in out.splitlines()[1:]] == [["acme", "sql", "4"]]
    assert cli("adapter", "list", "--tenant", "acme")[1] == out
    assert cli("adapter", "rm", "--tenant", "acme", "sql")[:2] == (
        0, "removed adapter sql of tenant acme\n")
    assert cli("adapter", "list")[1].count("\n") == 1  # the header only
    _fails_with(cli("adapter", "rm", "--tenant", "acme", "sql"), "has no adapter named 'sql'")


def test_adapter_upload_against_a_model_folder(cli, registry_config: RegistryConfig,
                                               tmp_path: Path) -> None:
    cli("tenant", "create", "acme")
    model = tmp_path / "tiny-model"
    model.mkdir()
    hf_config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                 "num_hidden_layers": 2, "intermediate_size": 128, "num_key_value_heads": 2,
                 "vocab_size": 300}
    (model / "config.json").write_text(json.dumps(hf_config))
    folder = write_adapter(tmp_path / "adapter")
    upload = ("adapter", "upload", "--tenant", "acme", "--name", "sql", str(folder))
    assert cli(*upload, "--model", str(model))[0] == 0
    _fails_with(cli(*upload[:-2], "other", str(folder), "--model", str(tmp_path)),
                "has no config.json")
    (model / "config.json").write_text(json.dumps(hf_config | {"hidden_size": 128}))
    _record_served_model(registry_config)
    _fails_with(cli(*upload[:-2], "other", str(folder), "--model", str(model)),
                "does not have the shape of the served base model 'tiny-llama'")


def test_prompts(cli, registry_config: RegistryConfig, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    cli("tenant", "create", "acme")
    _record_served_model(registry_config)
    folder = write_adapter(tmp_path / "a")
    cli("adapter", "upload", "--tenant", "acme", "--name", "sql", str(folder))
    text_file = tmp_path / "prompt.txt"
    text_file.write_text("You are a careful SQL assistant.\n")
    code, out, _ = cli("prompt", "add", "--tenant", "acme", "--name", "sql-sys", "--adapter", "sql",
                       str(text_file))
    assert code == 0 and out.startswith("added system prompt sql-sys for tenant acme (adapter sql)")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Be brief.")))
    assert cli("prompt", "add", "--tenant", "acme", "--name", "brief", "-")[0] == 0
    with Registry.open(registry_config) as registry:
        prompts = {p.name: p for p in registry.prompts.list("acme")}
    assert prompts["sql-sys"].text == "You are a careful SQL assistant.\n"
    assert prompts["brief"].text == "Be brief." and prompts["brief"].adapter is None
    _fails_with(cli("prompt", "add", "--tenant", "acme", "--name", "x", str(tmp_path / "none")),
                "No such file or directory")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    _fails_with(cli("prompt", "add", "--tenant", "acme", "--name", "x",
                    str(tmp_path / "latin1.txt")), "is not UTF-8 text")
    _fails_with(cli("prompt", "add", "--tenant", "acme", "--name", "x", "--adapter", "nope",
                    str(text_file)), "has no adapter named 'nope'")


def test_options_come_from_the_environment_or_before_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "from-env"))
    monkeypatch.delenv("LORAPLEX_DATABASE_URL", raising=False)
    assert main(["tenant", "create", "acme"]) == 0
    assert (tmp_path / "from-env" / "registry.db").is_file()
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert main(["--database-url", other, "tenant", "create", "beta"]) == 0
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", other)
    capsys.readouterr()
    assert main(["tenant", "list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["beta"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LORAPLEX_DATA_DIR")
    monkeypatch.delenv("LORAPLEX_DATABASE_URL")
    assert main(["tenant", "create", "gamma"]) == 0
    assert (tmp_path / "loraplex-data" / "registry.db").is_file()


def test_an_unreachable_database_is_one_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["tenant", "list", "--data-dir", str(tmp_path),
                 "--database-url", "postgresql://nobody:hunter2@127.0.0.1:1/none"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("loraplex: error: cannot open the registry database "
                          "postgresql://nobody:***@127.0.0.1:1/none: ")
    assert "hunter2" not in err


def test_the_server_keeps_compiled_kernels_in_its_data_dir(tmp_path, monkeypatch):
    """A restarted server (or a container whose data dir is a volume) finds Triton's compiled
    kernels where it left them; TRITON_CACHE_DIR, when set, is where they go."""
    import os

    import triton

    from loraplex.cli.serve import KERNEL_CACHE_DIR, keep_kernel_cache

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    folder = keep_kernel_cache(tmp_path)
    assert folder == tmp_path / KERNEL_CACHE_DIR and folder.is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(folder)
    assert triton.knobs.cache.dir == str(folder)  # what Triton's compiler reads

    chosen = tmp_path / "elsewhere"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(chosen))
    assert keep_kernel_cache(tmp_path / "data") == chosen and chosen.is_dir()
    assert not (tmp_path / "data" / KERNEL_CACHE_DIR).exists()


def test_serve_help_lists_every_engine_option(capsys: pytest.CaptureFixture[str]):
    """Each engine option's help is its field's docstring: a '%' in one (a figure in percent)
    once made `loraplex serve --help` crash in argparse's formatting."""
    from loraplex.cli.engine_flags import _option_fields, flag

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for name in _option_fields():
        assert flag(name) in text


def test_documents(cli, tmp_path: Path) -> None:
    """`document add/list/remove`; bad files and names are refused with the problem named, and
    what is stored stays as it was."""
    cli("tenant", "create", "acme")
    text = tmp_path / "faq.txt"
    text.write_text("Returns are accepted within 30 days.\n")
    assert cli("document", "add", "acme", "faq", str(text))[:2] == (
        0, "added document faq for tenant acme: 37 characters\n")
    _fails_with(cli("document", "add", "acme", "faq", str(text)),
                "tenant 'acme' already has a document named 'faq'")
    _fails_with(cli("document", "add", "nobody", "faq", str(text)), "tenant 'nobody'")
    _fails_with(cli("document", "add", "acme", "bad/name", str(text)), "invalid document name 'bad/name'")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    _fails_with(cli("document", "add", "acme", "empty", str(empty)), "the document is empty")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    _fails_with(cli("document", "add", "acme", "blob", str(binary)), "is not UTF-8 text")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"a\x00b")
    _fails_with(cli("document", "add", "acme", "nul", str(nul)), "holds a NUL character")
    large = tmp_path / "large.txt"
    large.write_text("x" * 200_001)
    _fails_with(cli("document", "add", "acme", "large", str(large)), "at most 200000 are allowed")
    _fails_with(cli("document", "add", "acme", "gone", str(tmp_path / "missing.txt")), "cannot read")
    code, out, _ = cli("document", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["TENANT", "NAME", "CHARACTERS"]
    assert [line.split()[:3] for line in lines[1:]] == [["acme", "faq", "37"]]
    assert cli("document", "remove", "acme", "faq")[:2] == (0, "removed document faq of tenant acme\n")
    _fails_with(cli("document", "remove", "acme", "faq"), "tenant 'acme' has no document named 'faq'")
    assert cli("document", "list", "--tenant", "acme")[1].splitlines()[1:] == []
