"""Fail fast: every flag, path, port and checkpoint header is checked before the target
model loads, every start-up error is one line with exit status 2; and SIGTERM drains with
the port still open (new requests get 503, not a refused connection).

Most tests call `specscope.cli.main` in-process with the model loader replaced by one that
fails the test if it is ever called; only the drain test runs a real `specscope serve`.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specscope.cli import main
from specscope.config import ModelConfig, ServerConfig
from specscope.draft.eagle3 import random_draft
from specscope.draft.formats import save_draft
from specscope.draft.loader import check_draft_files, default_draft_dir
from specscope.models.loader import load_model, weight_files
from specscope.models.safetensors_check import check_safetensors
from specscope.server.serve import bind_sockets

httpx = pytest.importorskip("httpx")


class ModelLoaded(BaseException):
    """Not an Exception, so that main's catch-all cannot turn it into an error line."""


@pytest.fixture
def no_load(monkeypatch):
    """The engine's constructor fails the test: start-up errors must come before it."""

    def refuse(*args, **kwargs):
        raise ModelLoaded("the target model was loaded before the error was found")

    monkeypatch.setattr("specscope.engine.llm.LLM", refuse)


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """main's exit status (argparse's SystemExit included) and its stderr."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- checkpoints to break --------------------------------------------------------------

TINY = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=512,
                   hidden_size=32, intermediate_size=64, num_layers=4, num_heads=2,
                   num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=128, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory) -> dict[str, Path]:
    """A small valid draft in the sglang and eagle formats."""
    root = tmp_path_factory.mktemp("drafts")
    d = random_draft(TINY, torch.float32, "cpu", draft_vocab_size=64, seed=0)
    return {fmt: save_draft(d, d.config, root / fmt, fmt) for fmt in ("sglang", "eagle")}


@pytest.fixture
def broken_draft(draft_dirs, tmp_path):
    """A copy of the valid sglang draft, to break."""
    out = tmp_path / "draft"
    shutil.copytree(draft_dirs["sglang"], out)
    return out


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def write_raw(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors-shaped file with any header (JSON-encoded unless bytes)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


F32_3 = {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}


# -- the safetensors header check ------------------------------------------------------


def test_a_sound_file_passes_and_lists_its_tensors(tmp_path):
    save_file({"a": torch.zeros(3), "b": torch.ones(2, 5, dtype=torch.bfloat16)},
              str(tmp_path / "ok.safetensors"), metadata={"format": "pt"})
    assert sorted(check_safetensors(tmp_path / "ok.safetensors")) == ["a", "b"]
    assert check_safetensors(write_raw(tmp_path / "e.safetensors", {})) == []


def test_a_truncated_file_says_how_much_is_missing(tmp_path):
    p = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(1000, 1000)}, str(p))  # 4.0 MB of data
    truncate(p, 0.5)
    with pytest.raises(ValueError) as e:
        check_safetensors(p, "draft checkpoint")
    assert str(e.value).startswith(f"draft checkpoint {p} is truncated: its header describes "
                                   f"4.0 MB of tensor data, the file holds 2.0 MB"), e.value


@pytest.mark.parametrize("header, data, length, what", [
    (b"", b"", 2**63, "header length 9.22e+18 exceeds the file size"),
    (b"not json at all", b"", None, "header is not valid JSON"),
    (b"\xff\xfe{}", b"", None, "header is not valid JSON"),
    ([1, 2], b"", None, "header is a JSON list, not an object"),
    ({"w": {"dtype": "F32", "shape": [3]}}, b"", None, "needs dtype, shape and data_offsets"),
    ({"w": {**F32_3, "dtype": "F33"}}, bytes(12), None, "unknown dtype 'F33'"),
    ({"w": {**F32_3, "shape": [-3]}}, bytes(12), None, "not a list of sizes"),
    ({"w": {**F32_3, "data_offsets": [12, 0]}}, bytes(12), None, "not [begin, end]"),
    ({"w": {**F32_3, "shape": [4]}}, bytes(12), None, "takes 16 bytes, but its data_offsets"),
    ({"w": F32_3, "v": F32_3}, bytes(12), None, "overlaps the tensor before it"),
    ({"w": {**F32_3, "data_offsets": [4, 16]}}, bytes(16), None, "leaves a gap of 4 bytes"),
    ({"w": F32_3}, bytes(20), None, "8 bytes follow the 12 bytes of tensor data"),
    ({"__metadata__": {"a": 1}}, b"", None, "__metadata__ must map strings to strings"),
])
def test_a_corrupt_header_is_named(tmp_path, header, data, length, what):
    p = write_raw(tmp_path / "x.safetensors", header, data, length)
    with pytest.raises(ValueError, match="^checkpoint .*x.safetensors is ") as e:
        check_safetensors(p)
    assert what in str(e.value), e.value


def test_a_file_shorter_than_a_header_length(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"abc")
    with pytest.raises(ValueError, match="is not a safetensors file: it holds 3 bytes"):
        check_safetensors(tmp_path / "x.safetensors")


# -- the target's own checkpoint -------------------------------------------------------


@pytest.fixture
def target_copy(tiny_model_dir, tmp_path) -> Path:
    out = tmp_path / "target"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_a_truncated_target_is_one_line_naming_the_file(target_copy, capsys):
    truncate(target_copy / "model.safetensors", 0.9)
    rc, err = run_main(["generate", "--model", str(target_copy), "--dtype", "fp32",
                        "--device", "cpu", "--draft", "none", "--max-tokens", "2"], capsys)
    line = one_line(err)
    assert rc == 2
    assert line.startswith(f"specscope: error: model checkpoint "
                           f"{target_copy / 'model.safetensors'} is truncated: "), line


def shard(model_dir: Path) -> list[str]:
    """Split model.safetensors into two shards with an index; the shard names."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    half = len(names) // 2
    weight_map = {}
    for fname, part in zip(shards, (names[:half], names[half:]), strict=True):
        save_file({n: tensors[n] for n in part}, str(model_dir / fname))
        weight_map.update({n: fname for n in part})
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


def test_a_sharded_target_checks_each_shard_before_reading_tensors(target_copy, monkeypatch):
    shards = shard(target_copy)
    assert len(weight_files(target_copy)) > 2
    write_raw(target_copy / shards[1], b"garbage", length=len(b"garbage"))

    def no_tensor_read(*args, **kwargs):
        raise AssertionError("a tensor was read before the headers were checked")

    monkeypatch.setattr("specscope.models.loader.load_weights", no_tensor_read)
    with pytest.raises(ValueError) as e:
        load_model(target_copy)
    assert str(e.value).startswith(f"model checkpoint {target_copy / shards[1]} is not a "
                                   f"safetensors file: its header is not valid JSON"), e.value


def test_an_index_naming_the_wrong_shard_is_an_error(target_copy):
    shard(target_copy)
    index = target_copy / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    name, fname = next(iter(raw["weight_map"].items()))
    other = next(f for f in raw["weight_map"].values() if f != fname)
    raw["weight_map"][name] = other
    index.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"lists tensors that their shards do not hold: "
                                         f"{name} \\({other}\\)"):
        weight_files(target_copy)


# -- the draft checkpoint, before the target loads -------------------------------------

CMDS = {  # each command that takes --draft, with what it needs besides
    "serve": ["serve", "--port", "0"],
    "generate": ["generate"],
    "profile": ["profile", "--out", "OUT"],
    "doctor": ["doctor"],
    "tune": ["tune", "--out", "OUT"],
}


def cmd(name: str, tmp_path: Path, *more: str) -> list[str]:
    return [a.replace("OUT", str(tmp_path / "out")) for a in CMDS[name]] + list(more)


@pytest.mark.parametrize("name", list(CMDS))
def test_a_missing_draft_fails_before_the_target_loads(name, tmp_path, no_load, capsys):
    rc, err = run_main(cmd(name, tmp_path, "--draft", str(tmp_path / "nope")), capsys)
    assert rc == 2
    assert one_line(err) == (f"specscope: error: draft '{tmp_path / 'nope'}' does not exist: "
                             f"give a draft checkpoint directory (or default, random or none)")


def _truncated(d: Path) -> str:
    truncate(d / "model.safetensors")
    return f"draft checkpoint {d / 'model.safetensors'} is truncated: its header describes "


def _garbage_header(d: Path) -> str:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(b"\x00\x00\x00\x00\x00\x00\x00\x7f" + data[8:])
    return f"draft checkpoint {d / 'model.safetensors'} is not a safetensors file"


def _garbage_json(d: Path) -> str:
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:12] = b"@@@@"
    (d / "model.safetensors").write_bytes(bytes(data))
    return f"draft checkpoint {d / 'model.safetensors'} is not a safetensors file: its " \
           f"header is not valid JSON"


def _bad_config(d: Path) -> str:
    (d / "config.json").write_text("{not json")
    return f"draft config {d / 'config.json'} is not valid JSON"


def _not_a_draft(d: Path) -> str:
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    return f"{d / 'config.json'}: not an EAGLE-3 draft config"


def _no_weights(d: Path) -> str:
    (d / "model.safetensors").unlink()
    return f"draft checkpoint {d} holds no weights"


@pytest.mark.parametrize("breaks", [_truncated, _garbage_header, _garbage_json, _bad_config,
                                    _not_a_draft, _no_weights])
def test_a_broken_draft_is_one_line_before_the_target_loads(breaks, broken_draft, tmp_path,
                                                             no_load, capsys):
    want = breaks(broken_draft)
    rc, err = run_main(cmd("serve", tmp_path, "--draft", str(broken_draft)), capsys)
    assert rc == 2
    line = one_line(err)
    assert line.startswith(f"specscope: error: {want}"), line


def test_every_safetensors_file_of_a_draft_is_checked(draft_dirs, broken_draft):
    assert check_draft_files(draft_dirs["sglang"]) == draft_dirs["sglang"]
    write_raw(broken_draft / "extra.safetensors", {"w": F32_3}, bytes(4))
    with pytest.raises(ValueError, match="extra.safetensors is truncated"):
        check_draft_files(broken_draft)


def test_a_truncated_pytorch_model_bin_draft(draft_dirs, tmp_path):
    from safetensors.torch import load_file

    d = shutil.copytree(draft_dirs["eagle"], tmp_path / "eagle")
    # The official EAGLE drafts' file (specscope writes model.safetensors)
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    assert check_draft_files(d) == d
    truncate(d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin is truncated or corrupt"):
        check_draft_files(d)


def test_the_shipped_default_draft_is_checked_and_sound():
    assert check_draft_files("default") == default_draft_dir()


@pytest.mark.parametrize("draft", ["random", "none"])
def test_special_draft_names_are_not_paths(draft, tmp_path, no_load, capsys):
    """'random' and 'none' reach the model load (here: the refusing stand-in)."""
    with pytest.raises(ModelLoaded):
        main(cmd("serve", tmp_path, "--draft", draft))


# -- flags -----------------------------------------------------------------------------

BAD_FLAGS = [
    (["serve", "--port", "70000"], "--port", "must be in [0, 65535], got 70000"),
    (["serve", "--port", "-1"], "--port", "must be in [0, 65535], got -1"),
    (["serve", "--max-queue", "-1"], "--max-queue", "must be >= 0, got -1"),
    (["serve", "--shutdown-timeout", "-5"], "--shutdown-timeout",
     "must be a finite number >= 0, got -5"),
    (["serve", "--shutdown-timeout", "inf"], "--shutdown-timeout", "finite number >= 0"),
    (["serve", "--max-request-bytes", "100"], "--max-request-bytes", "must be >= 1024"),
    (["serve", "--max-prompt-tokens", "0"], "--max-prompt-tokens", "must be >= 1"),
    (["serve", "--request-read-timeout", "0"], "--request-read-timeout",
     "must be a finite number > 0"),
    (["serve", "--max-stop-strings", "-1"], "--max-stop-strings", "must be >= 0"),
    (["serve", "--max-stop-chars", "0"], "--max-stop-chars", "must be >= 1"),
    (["serve", "--max-n", "0"], "--max-n", "must be >= 1"),
    (["serve", "--num-steps", "1000"], "--num-steps/--speculative-num-steps",
     "must be in [1, 16]"),
    (["serve", "--auto-tune-prompts", "0"], "--auto-tune-prompts", "must be >= 1"),
    (["serve", "--max-queue", "many"], "--max-queue", "must be an integer, got 'many'"),
    (["generate", "--max-tokens", "many"], "--max-tokens", "invalid int value: 'many'"),
    (["generate", "--max-model-len", "0"], "--max-model-len", "must be >= 1"),
    (["profile", "--num-prompts", "0"], "--num-prompts", "must be >= 1"),
    (["bench", "--url", "http://x", "--concurrency", "0"], "--max-concurrency/--concurrency",
     "must be an integer >= 1"),
    (["bench", "--url", "http://x", "--timeout", "0"], "--timeout", "> 0"),
    (["tune", "--confirm", "-1"], "--confirm", "must be >= 0"),
    (["doctor", "--draft", "default", "--num-prompts", "-2"], "--num-prompts", ">= 1"),
    (["train-draft", "--out", "x", "--lr", "-1"], "--lr", "> 0"),
]


@pytest.mark.parametrize("argv, flag, what", BAD_FLAGS, ids=[" ".join(a) for a, _, _ in
                                                             BAD_FLAGS])
def test_a_bad_flag_is_one_line_naming_it(argv, flag, what, no_load, capsys):
    rc, err = run_main(argv, capsys)
    assert rc == 2
    line = one_line(err)
    prog = f"specscope {argv[0]}"
    assert line.startswith(f"{prog}: error: argument {flag}: ") and what in line, line
    assert line.endswith(f"(see {prog} --help)"), line


LATE_CHECKS = [  # found after the target loaded, before
    (["generate", "--draft", "none", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["profile", "--draft", "none", "--max-tokens", "0"], "max_tokens must be a positive"),
    (["serve", "--port", "0", "--draft", "default", "--guardrail-margin", "1"],
     "--guardrail-window must be >= 1 and --guardrail-margin in [0, 1)"),
    (["generate", "--draft", "none", "--messages", "[{not json"],
     "--messages is not valid JSON"),
    (["serve", "--port", "0", "--draft", "default", "--auto-tune", "--auto-tune-dataset",
      "/nope.jsonl"], "dataset '/nope.jsonl' is neither a built-in set"),
    (["doctor", "--draft", "default", "--prompts", "/nope.jsonl"],
     "dataset '/nope.jsonl' is neither a built-in set"),
    (["serve", "--port", "0", "--draft", "none", "--dtype", "fp33"], "unknown dtype 'fp33'"),
    (["tune", "--device", "tpu", "--out", "OUT"], "device must be cpu, cuda, cuda:N or auto"),
    (["serve", "--port", "0", "--draft", "random", "--draft-layer-ids", "a,b"],
     "--draft-layer-ids must be comma-separated integers"),
]


@pytest.mark.parametrize("argv, what", LATE_CHECKS, ids=[a[0] + " " + w for a, w in
                                                         LATE_CHECKS])
def test_other_bad_arguments_fail_before_the_target_loads(argv, what, tmp_path, no_load,
                                                          capsys):
    rc, err = run_main([a.replace("OUT", str(tmp_path / "out")) for a in argv], capsys)
    assert rc == 2
    assert one_line(err).startswith(f"specscope: error: {what}"), err


def test_parser_errors_of_every_level_are_one_line(capsys):
    rc, err = run_main([], capsys)
    assert rc == 2 and one_line(err) == ("specscope: error: the following arguments are "
                                         "required: command (see specscope --help)")
    rc, err = run_main(["serve", "--no-such-flag"], capsys)
    assert rc == 2 and one_line(err).startswith("specscope: error: unrecognized arguments")
    rc, err = run_main(["serve", "--log-level", "loud"], capsys)
    assert rc == 2 and "argument --log-level: invalid choice: 'loud'" in one_line(err)


def test_help_still_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: specscope serve")
    for flag in ("--api-key", "--enable-admin", "--enable-docs", "--allowed-hosts",
                 "--max-request-bytes", "--max-prompt-tokens", "--request-read-timeout",
                 "--max-stop-strings", "--max-stop-chars", "--max-n", "--max-queue",
                 "--shutdown-timeout", "--served-model-name"):
        assert flag in out, flag


# -- the server's configuration --------------------------------------------------------


@pytest.fixture
def started(monkeypatch):
    """Stand-ins for the model, the app and uvicorn: what serve would start with."""
    seen: dict = {}

    class FakeLLM:
        def __init__(self, *args, **kwargs) -> None:
            seen["loaded"] = True

        def describe(self) -> str:
            return "a fake"

    def create_app(llm, config=None, **kwargs):
        seen["config"] = config
        return "app"

    def serve(app, **kwargs):
        seen["serve"] = kwargs
        seen["sockets"] = [s.getsockname() for s in kwargs["sockets"]]
        return 0

    monkeypatch.setattr("specscope.engine.llm.LLM", FakeLLM)
    monkeypatch.setattr("specscope.server.create_app", create_app)
    monkeypatch.setattr("specscope.server.serve.serve", serve)
    monkeypatch.delenv("SPECSCOPE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return seen


def test_serve_flags_build_the_server_config(started, capsys):
    port = free_port()
    assert main(["serve", "--draft", "none", "--port", str(port), "--api-key", "k1",
                 "--api-key", "k2", "--enable-admin", "--enable-docs", "--allowed-hosts",
                 "a.example, B.example", "--max-request-bytes", "2048",
                 "--max-prompt-tokens", "100", "--request-read-timeout", "2.5",
                 "--max-stop-strings", "0", "--max-stop-chars", "8", "--max-n", "2",
                 "--max-queue", "0", "--shutdown-timeout", "0", "--served-model-name",
                 "m"]) == 0
    assert started["config"] == ServerConfig(
        served_model_name="m", max_queue=0, api_keys=("k1", "k2"), enable_admin=True,
        enable_docs=True, allowed_hosts=("a.example", "b.example"), max_request_bytes=2048,
        max_prompt_tokens=100, request_read_timeout=2.5, max_stop_strings=0,
        max_stop_chars=8, max_n=2, shutdown_timeout=0.0)
    assert started["sockets"] == [("127.0.0.1", port)]
    assert started["serve"]["shutdown_timeout"] == 0.0


def test_serve_defaults_are_the_server_configs(started, monkeypatch):
    assert main(["serve", "--draft", "none", "--port", "0"]) == 0
    assert started["config"] == ServerConfig()
    monkeypatch.setenv("SPECSCOPE_API_KEY", "from-env")
    assert main(["serve", "--draft", "none", "--port", "0"]) == 0
    assert started["config"].api_keys == ("from-env",)
    assert main(["serve", "--draft", "none", "--port", "0", "--api-key", "flag"]) == 0
    assert started["config"].api_keys == ("flag",)  # a flag overrides the environment
    monkeypatch.delenv("SPECSCOPE_API_KEY")
    monkeypatch.setenv("VLLM_API_KEY", "vllm-env")  # vLLM's variable, for a migrating user
    assert main(["serve", "--draft", "none", "--port", "0"]) == 0
    assert started["config"].api_keys == ("vllm-env",)


def test_admin_without_a_key_fails_before_the_target_loads(no_load, capsys, monkeypatch):
    monkeypatch.delenv("SPECSCOPE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    rc, err = run_main(["serve", "--draft", "none", "--port", "0", "--enable-admin"], capsys)
    assert rc == 2
    assert one_line(err).startswith("specscope: error: enable_admin needs an API key")


def test_an_unexpected_start_up_error_is_one_line(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr("specscope.engine.llm.LLM", broken)
    rc, err = run_main(["serve", "--draft", "none", "--port", "0"], capsys)
    assert rc == 2
    assert one_line(err) == ("specscope: error: KeyError: 'boom' (specscope -v ... prints "
                             "the traceback)")


# -- the listening socket, bound before the model loads --------------------------------


def test_a_port_in_use_fails_before_the_target_loads(no_load, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, err = run_main(["serve", "--draft", "none", "--port", str(port)], capsys)
    assert rc == 2
    assert one_line(err) == (f"specscope: error: cannot listen on 127.0.0.1:{port}: Address "
                             f"already in use (another server holds it: stop that one or "
                             f"choose another --port)")


@pytest.mark.parametrize("host, why", [
    ("999.1.1.1", "999.1.1.1 is not an IPv4 address"),
    ("no-such-host.invalid", ""),
])
def test_a_bad_host_fails_before_the_target_loads(host, why, no_load, capsys):
    rc, err = run_main(["serve", "--draft", "none", "--host", host], capsys)
    assert rc == 2
    assert one_line(err).startswith(f"specscope: error: cannot listen on {host}:8000: {why}")


def test_the_port_is_bound_when_the_model_loads(monkeypatch, capsys):
    port = free_port()
    seen = {}

    def probe(*args, **kwargs):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                seen["bound"] = e.errno
        raise RuntimeError("stop here")

    monkeypatch.setattr("specscope.engine.llm.LLM", probe)
    rc, err = run_main(["serve", "--draft", "none", "--port", str(port)], capsys)
    assert rc == 2 and one_line(err) == "specscope: error: stop here"
    import errno

    assert seen == {"bound": errno.EADDRINUSE}
    with socket.socket() as s:  # released again after the failed start
        s.bind(("127.0.0.1", port))


def test_bound_sockets_are_tcp_and_ipv6_works():
    (sock,) = bind_sockets("127.0.0.1", 0)
    with sock:
        assert sock.proto == socket.IPPROTO_TCP  # so asyncio sets TCP_NODELAY
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
    try:
        (six,) = bind_sockets("::1", 0)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    with six:
        assert six.family == socket.AF_INET6 and six.proto == socket.IPPROTO_TCP
        six.listen()
        port = six.getsockname()[1]
        with pytest.raises(OSError, match=rf"^cannot listen on \[::1\]:{port}: Address "
                                          rf"already in use"):
            bind_sockets("::1", port)


# -- SIGTERM: drain with the port open -------------------------------------------------


def _wait_for(pred, what: str, proc, log_path: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not pred():
        assert proc.poll() is None, f"serve exited: {log_path.read_text()}"
        assert time.time() < deadline, f"{what}: {log_path.read_text()}"
        time.sleep(0.05)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigterm_answers_new_requests_503_while_a_stream_finishes(long_tiny_dir, tmp_path):
    """After SIGTERM, with a generous --shutdown-timeout, the running stream completes;
    meanwhile a new connection is accepted and answered 503 server_shutting_down (not
    refused); then the process exits 0 with no traceback."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specscope.cli", "serve", str(long_tiny_dir), "--dtype",
             "fp32", "--device", "cpu", "--port", str(port), "--served-model-name", "tiny",
             "--shutdown-timeout", "60", "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _healthy(url), "serve did not come up", proc, log_path)
        body = {"model": "tiny", "prompt": "Count:", "max_tokens": 800, "ignore_eos": True,
                "temperature": 0, "stream": True}
        lines: list[str] = []
        first = threading.Event()

        def read() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for ln in r.iter_lines():
                    if ln:
                        lines.append(ln)
                        first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(60), log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        # The worker says when the drain starts; a request after that must be refused.
        _wait_for(lambda: "shutting down:" in log_path.read_text(), "no drain", proc, log_path)
        with httpx.Client(base_url=url, timeout=30) as fresh:  # a new connection
            late = fresh.post("/v1/completions", json={**body, "stream": False})
        still_streaming = reader.is_alive()
        reader.join(timeout=120)
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "server_shutting_down"
        assert still_streaming, "the stream ended before the new request: nothing drained"
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length", last
        assert proc.wait(timeout=20) == 0
        assert "Traceback" not in log_path.read_text(), log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
