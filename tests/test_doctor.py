"""specscope doctor against the shipped default draft: the healthy draft passes, and every
planted fault is detected and named. Converters round-trip bit-exactly.

The target's probe data (greedy answers and activations) is computed once for the module and
shared by every case, as a user checking several drafts would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specscope import LLM
from specscope.doctor import run_doctor
from specscope.doctor.probe import target_probe_data
from specscope.draft.convert import convert_draft
from specscope.draft.loader import default_draft_dir

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def llm(default_model_dir) -> LLM:
    return LLM(str(default_model_dir), dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def probe(llm):
    from specscope.doctor import default_probe_prompts

    ids = [llm.encode_prompt(p) for p in default_probe_prompts(8)]
    return target_probe_data(llm.model, ids, 48)


def _copy(tmp_path: Path, name: str = "d") -> Path:
    d = tmp_path / name
    shutil.copytree(default_draft_dir(), d)
    return d


def _edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, fn) -> None:
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"))


def _set_ids(ids, keep_provenance: bool = False):
    """Plant tap ids. Without its provenance block (as a SpecForge draft has none) only the
    probe can tell; with it, the static check knows the trained ids."""
    def f(cfg):
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        if not keep_provenance:
            cfg.pop("specscope_provenance", None)
    return f


def _no_provenance(cfg) -> None:
    cfg.pop("specscope_provenance", None)


def test_healthy_default_draft_passes(llm, probe):
    r = run_doctor(llm, "default", probe_data=probe)
    assert r.healthy, r.format()
    assert "probe.wiring_ok" in r.codes()
    conf = r.wirings[0]
    assert conf.names[0] == "configured" and conf.ids == (1, 14, 26)
    assert conf.accept_length > 1.3
    names = {n for w in r.wirings for n in w.names}
    assert {"shifted +1", "shifted -1", "other convention", "embedding first",
            "default"} <= names
    text = r.format()
    assert "HEALTHY" in text and "wiring probe" in text


def test_shifted_ids_are_caught_by_the_probe_with_the_fix(tmp_path, llm, probe):
    d = _copy(tmp_path)
    _edit_config(d, _set_ids([2, 15, 27]))
    r = run_doctor(llm, str(d), probe_data=probe)
    assert not r.healthy and "wiring.shifted_plus1" in r.codes(), r.format()
    finding = next(f for f in r.findings if f.code == "wiring.shifted_plus1")
    assert "--draft-layer-ids 1,14,26" in finding.fix
    assert '"eagle_aux_hidden_state_layer_ids": [1, 14, 26]' in finding.fix


@pytest.mark.parametrize("ids", [[0, 13, 25], [2, 15, 27], [-1, 14, 26]])
def test_ids_off_the_trained_ones_are_caught_statically(tmp_path, llm, ids):
    """With the provenance block the trained taps are known: any other ids (here -1, which
    this draft tolerates almost as well as the right ones, so the probe calls it within
    noise) are an error before any probe runs."""
    d = _copy(tmp_path)
    _edit_config(d, _set_ids(ids, keep_provenance=True))
    r = run_doctor(llm, str(d))
    assert not r.healthy and "static.provenance_ids" in r.codes(), r.format()
    assert not r.wirings  # no probe needed
    f = next(f for f in r.findings if f.code == "static.provenance_ids")
    assert "--draft-layer-ids 1,14,26" in f.fix and str(ids) in f.message
    # an override that restores the trained ids is healthy again (statically)
    from specscope.doctor.checks import static_checks

    ok = static_checks(d, llm.model_config, None, (1, 14, 26))
    assert "static.provenance_ids" not in {x.code for x in ok}


def test_judge_names_a_minus_one_shift_and_a_swapped_convention():
    """The probe's verdict and fix for ids read in the wrong convention (one below the
    trained ones), from synthetic measurements: the alternative is clearly better."""
    from specscope.doctor import judge
    from specscope.doctor.probe import Wiring

    g = torch.Generator().manual_seed(0)
    base = 3.0 + 0.3 * torch.randn(400, generator=g)
    conf = Wiring(ids=(0, 13, 25), names=["configured"], loss=float(base.mean()),
                  token_loss=base, acceptance=[0.4] * 5, accept_length=1.6)
    good = base - 0.4 + 0.05 * torch.randn(400, generator=g)
    alt = Wiring(ids=(1, 14, 26), names=["shifted +1", "other convention", "default"],
                 loss=float(good.mean()), token_loss=good, acceptance=[0.6] * 5,
                 accept_length=2.2)
    worse = Wiring(ids=(-1, 12, 24), names=["shifted -1"], loss=3.5,
                   token_loss=base + 0.5, acceptance=[0.3] * 5, accept_length=1.4)
    found = judge(conf, [conf, alt, worse], "speculators", 30)
    codes = [f.code for f in found]
    assert codes[0] == "wiring.shifted_minus1" and "wiring.convention" in codes, codes
    err = next(f for f in found if f.severity == "error")
    assert "--draft-layer-ids 1,14,26" in err.fix and "[2, 15, 27] (input-to-layer)" in err.fix
    # within noise: no finding beyond "ok"
    same = Wiring(ids=(1, 14, 26), names=["shifted +1"], loss=conf.loss,
                  token_loss=base + 0.01 * torch.randn(400, generator=g),
                  acceptance=[0.4] * 5, accept_length=1.62)
    assert [f.code for f in judge(conf, [conf, same], "sglang", 30)] == ["probe.wiring_ok"]
    # A short probe's accept-length lead that the cross-entropy contradicts is noise (the
    # wheel's doctor on 12 answer tokens: 1.70 vs 1.52 at 3.020 vs 2.821 nats).
    lucky = Wiring(ids=(-1, 12, 24), names=["shifted -1"], loss=conf.loss + 0.2,
                   token_loss=base + 0.2 + 0.3 * torch.randn(400, generator=g),
                   acceptance=[0.5] * 5, accept_length=1.8)
    assert [f.code for f in judge(conf, [conf, lucky], "sglang", 30)] == ["probe.wiring_ok"]


def test_judge_needs_a_significant_accept_length_lead():
    """An accept-length lead that the cross-entropy does not contradict counts only when the
    paired per-token accepted runs show it beyond noise: a CI machine's doctor on 12 answer
    tokens saw 1.62 vs 1.42 at 2.551 vs 2.588 nats from two tokens' runs."""
    from specscope.doctor import judge
    from specscope.doctor.probe import Wiring

    conf_loss = torch.tensor([2.6] * 12)
    conf = Wiring(ids=(1, 14, 26), names=["configured"], loss=2.588, token_loss=conf_loss,
                  token_run=torch.tensor([0.0] * 7 + [1.0] * 5), acceptance=[0.42, 0, 0],
                  accept_length=1.42)
    short = Wiring(ids=(-1, 14, 26), names=["embedding first"], loss=2.551,
                   token_loss=conf_loss + 0.3 * torch.randn(12, generator=torch.Generator()
                                                            .manual_seed(1)),
                   token_run=torch.tensor([0.0] * 6 + [1.0] * 5 + [2.0]),
                   acceptance=[0.5, 0.25, 0], accept_length=1.62)
    assert [f.code for f in judge(conf, [conf, short], "sglang", 30)] == ["probe.wiring_ok"]
    # The same lead over 400 tokens, each gaining a token a quarter of the time: flagged.
    many = torch.tensor([0.0, 0.0, 0.0, 1.0]).repeat(100)
    conf.token_run, conf.token_loss = torch.zeros(400), torch.full((400,), 2.6)
    short.token_run, short.token_loss = many, torch.full((400,), 2.6)
    assert judge(conf, [conf, short], "sglang", 30)[0].code == "wiring.embedding_expected"

def test_embedding_in_place_of_the_first_tap_is_caught(tmp_path, llm, probe):
    """A speculators draft whose first id is input-to-layer 0: the embedding output."""
    d = convert_draft(default_draft_dir(), tmp_path / "sp", "speculators")
    _edit_config(d, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 15, 27]))
    _edit_config(d, _no_provenance)  # as a draft from elsewhere: only the probe can tell
    r = run_doctor(llm, str(d), probe_data=probe)
    assert "static.embedding_tap" in r.codes()
    assert not r.healthy and "wiring.embedding" in r.codes(), r.format()


def test_swapped_convention_is_caught(tmp_path, llm):
    """Output-of-layer ids written into the speculators (input-to-layer) field: the
    converters carry the provenance block, so the static check names the trained taps."""
    d = convert_draft(default_draft_dir(), tmp_path / "sp", "speculators")
    _edit_config(d, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 14, 26]))
    r = run_doctor(llm, str(d))
    assert not r.healthy and "static.provenance_ids" in r.codes(), r.format()
    f = next(f for f in r.findings if f.code == "static.provenance_ids")
    assert "[0, 13, 25]" in f.message and "--draft-layer-ids 1,14,26" in f.fix


def test_permuted_d2t_is_caught(tmp_path, llm):
    d = _copy(tmp_path)

    def permute(t):
        g = torch.Generator().manual_seed(0)
        t["d2t"] = t["d2t"][torch.randperm(t["d2t"].numel(), generator=g)]
    _edit_tensors(d, permute)
    r = run_doctor(llm, str(d))
    assert not r.healthy and "static.vocab_map" in r.codes(), r.format()


def test_missing_lm_head_is_caught(tmp_path, llm):
    d = _copy(tmp_path)
    _edit_tensors(d, lambda t: t.pop("lm_head.weight"))
    r = run_doctor(llm, str(d))
    assert not r.healthy and "static.lm_head_missing" in r.codes(), r.format()


def test_random_init_decoder_weight_is_caught(tmp_path, llm, probe):
    d = _copy(tmp_path)

    def scramble(t):
        for name in ("midlayer.mlp.down_proj.weight", "midlayer.self_attn.o_proj.weight"):
            w = t[name]
            g = torch.Generator().manual_seed(1)
            t[name] = (torch.randn(w.shape, generator=g) * w.float().std()).to(w.dtype)
    _edit_tensors(d, scramble)
    r = run_doctor(llm, str(d), probe_data=probe)
    assert not r.healthy and "probe.untrained" in r.codes(), r.format()


def test_fc_width_mismatch_is_caught(tmp_path, llm):
    d = _copy(tmp_path)
    _edit_tensors(d, lambda t: t.update({"fc.weight": t["fc.weight"][:, :2 * 576].clone()}))
    r = run_doctor(llm, str(d))
    assert not r.healthy and "static.fc_width" in r.codes(), r.format()
    f = next(f for f in r.findings if f.code == "static.fc_width")
    assert "1152" in f.message and "1728" in f.message


def test_cli_doctor_exit_codes(tmp_path, default_model_dir, capsys):
    from specscope.cli import main

    d = _copy(tmp_path)
    _edit_tensors(d, lambda t: t.pop("lm_head.weight"))
    assert main(["doctor", "--model", str(default_model_dir), "--draft", str(d), "--json",
                 "--device", "cpu"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["healthy"] is False
    assert any(f["code"] == "static.lm_head_missing" for f in out["findings"])


# -- converters ----------------------------------------------------------------------------

def test_converters_round_trip_bit_exactly(tmp_path):
    src = default_draft_dir()
    a = convert_draft(src, tmp_path / "sp", "speculators")
    b = convert_draft(a, tmp_path / "eagle", "eagle")
    c = convert_draft(b, tmp_path / "sg", "sglang")
    orig, back = load_file(str(src / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert orig.keys() == back.keys()
    for k in orig:
        assert orig[k].dtype == back[k].dtype and torch.equal(orig[k], back[k]), k
    sp_cfg = json.loads((a / "config.json").read_text())
    assert sp_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # input-to-layer
    # speculators names the target it belongs to (vLLM reads it): the draft's training target
    src_prov = json.loads((src / "config.json").read_text())["specscope_provenance"]
    verifier = sp_cfg["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == src_prov["target"] and verifier["name_or_path"]
    assert verifier["architectures"] == ["LlamaForCausalLM"]
    assert (b / "model.safetensors").exists() and not (b / "pytorch_model.bin").exists()
    named = convert_draft(src, tmp_path / "sp2", "speculators", target_name="org/target")
    assert json.loads((named / "config.json").read_text())["speculators_config"][
        "verifier"]["name_or_path"] == "org/target"
    sg_cfg = json.loads((c / "config.json").read_text())
    assert sg_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    prov = sg_cfg["specscope_provenance"]
    assert prov["converted_from"]["format"] == "eagle" and prov["target_num_layers"] == 30
    sp = load_file(str(a / "model.safetensors"))
    assert "layers.0.mlp.down_proj.weight" in sp


def test_convert_needs_the_layer_count(tmp_path):
    d = _copy(tmp_path)
    _edit_config(d, lambda c: c.pop("specscope_provenance"))
    with pytest.raises(ValueError, match="--target-layers"):
        convert_draft(d, tmp_path / "x", "speculators")
    out = convert_draft(d, tmp_path / "x", "speculators", num_target_layers=30)
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] \
        == [2, 15, 27]


def test_serve_doctor_refuses_a_broken_draft(tmp_path, default_model_dir, capsys):
    from specscope.cli import main

    d = _copy(tmp_path)
    _edit_tensors(d, lambda t: t.update({"fc.weight": t["fc.weight"][:, :576].clone()}))
    assert main(["serve", str(default_model_dir), "--draft", str(d), "--doctor",
                 "--device", "cpu", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "static.fc_width" in err and "not serving" in err
