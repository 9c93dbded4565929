"""Fast tests for the embedded demo task, tokenizers and tiny models."""

from __future__ import annotations

import json

import pytest

from graftrl.models.rewards import MathVerifier, extract_last_boxed

torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from graftrl.embedded.models import (  # noqa: E402
    MODEL_SPECS,
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_model,
    build_spec,
    count_parameters,
)
from graftrl.embedded.task import (  # noqa: E402
    FAMILIES,
    make_problems,
    make_split,
    supervised_text,
)
from graftrl.embedded.warmstart import (  # noqa: E402
    EMBEDDED_MIXES,
    REPORT_NAME,
    encode_pair,
    fingerprint,
    prepare_embedded_models,
    warm_start,
)

TEXTS = ["37+45=", "\\boxed{82}", "a  b\tc\nd \\frac{1}{2} {x}", " leading and trailing  "]


def _corpus() -> list[str]:
    ps = make_problems(None, 300, seed=0)
    return [p.problem + "=" for p in ps] + [supervised_text(p) for p in ps]


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(_corpus(), vocab_size=300)


def test_problems_deterministic_and_distinct():
    a = make_problems(None, 200, seed=3)
    b = make_problems(None, 200, seed=3)
    c = make_problems(None, 200, seed=4)
    assert a == b
    assert a != c
    assert len({p.id for p in a}) == 200
    assert {p.family for p in a} == set(FAMILIES)
    only = make_problems(["sub"], 50, seed=1)
    assert all(p.family == "sub" for p in only)
    weighted = make_problems({"add": 1.0, "sub": 0.0}, 20, seed=1)
    assert all(p.family == "add" for p in weighted)


def test_problem_answers_are_correct():
    for p in make_problems(None, 100, seed=5):
        assert str(eval(p.problem)) == p.answer  # the problems are plain integer expressions


def test_split_disjoint_and_stable():
    train, ev = make_split(seed=0, n_train=500, n_eval=128)
    assert len(train) == 500 and len(ev) == 128
    assert not {p.id for p in train} & {p.id for p in ev}
    _, ev2 = make_split(seed=0, n_train=100, n_eval=128)
    assert ev == ev2


def test_exclude_ids():
    ex = make_problems(None, 100, seed=0)
    more = make_problems(None, 100, seed=0, exclude_ids={p.id for p in ex})
    assert not {p.id for p in ex} & {p.id for p in more}


def test_supervised_text_is_rewarded_by_the_verifier():
    problems = make_problems(None, 20, seed=2)
    texts = [supervised_text(p) for p in problems]
    assert all(extract_last_boxed(t) == p.answer for t, p in zip(texts, problems, strict=True))
    with MathVerifier() as verifier:
        assert verifier.score(texts, [p.answer for p in problems]) == [1.0] * 20
        wrong = [
            t.replace("{" + p.answer, "{" + p.answer + "1") for t, p in zip(texts, problems, strict=True)
        ]
        assert verifier.score(wrong, [p.answer for p in problems]) == [0.0] * 20


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tokenizer_round_trip_and_specials(kind, bpe, tmp_path):
    tok = build_char_tokenizer() if kind == "char" else bpe
    assert tok.eos_token_id != tok.pad_token_id
    assert tok.bos_token_id not in (tok.eos_token_id, tok.pad_token_id)
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=False)
        assert tok.eos_token_id not in ids and tok.bos_token_id not in ids
        assert tok.decode(ids) == t
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.is_fast
    for t in TEXTS:
        assert loaded.encode(t, add_special_tokens=False) == tok.encode(t, add_special_tokens=False)
        assert loaded.decode(loaded.encode(t, add_special_tokens=False)) == t
    assert loaded.eos_token_id == tok.eos_token_id and loaded.pad_token_id == tok.pad_token_id


def test_tokenizers_differ(bpe):
    char = build_char_tokenizer()
    text = "\\boxed{82}"
    assert len(bpe.encode(text, add_special_tokens=False)) < len(char.encode(text, add_special_tokens=False))
    # digits stay single tokens under BPE
    assert len(bpe.encode("1234", add_special_tokens=False)) == 4


@pytest.mark.parametrize("name", list(MODEL_SPECS))
def test_specs_build_save_load(name, tmp_path):
    spec = MODEL_SPECS[name]
    model, tok = build_spec(name, _corpus())
    assert model.config.model_type == spec["arch"]
    assert 0.5e6 <= count_parameters(model) <= 1.5e6
    assert model.config.eos_token_id == tok.eos_token_id
    if spec["arch"] == "gpt2":
        assert model.config.resid_pdrop == model.config.embd_pdrop == model.config.attn_pdrop == 0.0
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    t2 = AutoTokenizer.from_pretrained(tmp_path)
    ids, n_prompt = encode_pair(t2, spec["template"], "37+45", "\\boxed{82}")
    assert ids[-1] == t2.eos_token_id and 0 < n_prompt < len(ids)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.allclose(model(x).logits, m2(x).logits, atol=1e-5)


def test_build_model_rejects_unknown_arch():
    with pytest.raises(ValueError):
        build_model("mamba", build_char_tokenizer())  # type: ignore[arg-type]


def test_fingerprint_changes_with_settings():
    a = fingerprint("llama-char", EMBEDDED_MIXES["llama-char"], 0, target_accuracy=0.8)
    assert a == fingerprint("llama-char", EMBEDDED_MIXES["llama-char"], 0, target_accuracy=0.8)
    assert a != fingerprint("llama-char", EMBEDDED_MIXES["llama-char"], 1, target_accuracy=0.8)
    assert a != fingerprint("llama-char", EMBEDDED_MIXES["llama-char"], 0, target_accuracy=0.7)


def test_tiny_warm_start_and_cache(tmp_path, monkeypatch):
    # a 5-step warm-start: checks the save layout and the report, not the accuracy
    rep = warm_start(
        "llama-char",
        {"add": 1.0},
        tmp_path / "m",
        seed=0,
        target_accuracy=1.1,
        max_steps=5,
        threads=2,
        check_every_steps=100,
        check_problems=8,
    )
    assert rep["steps"] == 5 and not rep["reached_target"]
    saved = json.loads((tmp_path / "m" / REPORT_NAME).read_text())
    assert saved["fingerprint"] == rep["fingerprint"] and "add" in saved["accuracy"]
    AutoModelForCausalLM.from_pretrained(tmp_path / "m")


@pytest.mark.slow
def test_prepare_quick_and_cached(tmp_path):
    paths = prepare_embedded_models(tmp_path, quick=True, seed=0)
    assert set(paths) == set(MODEL_SPECS)
    stamps = {name: (path / "model.safetensors").stat().st_mtime_ns for name, path in paths.items()}
    again = prepare_embedded_models(tmp_path, quick=True, seed=0)
    assert again == paths
    # the cache hit trains nothing: the saved weights are the same files
    assert {name: (path / "model.safetensors").stat().st_mtime_ns for name, path in again.items()} == stamps
