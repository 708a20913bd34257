"""HF transformers models decoding through replaygen (replaygen.integrations.transformers), on tiny randomly
initialised configs of each supported class: greedy tokens and logits as HF's own `generate`, the speculative loop's
tokens as greedy decoding's, and a rejected draft leaving every state as if it never ran; on the replay kernels, and
for some models on the modules' baseline kernels (`kernels="baseline"`) too."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from replaygen.cli import main  # noqa: E402
from replaygen.errors import ReplaygenError  # noqa: E402
from replaygen.integrations.transformers import attach, prompt_lookup  # noqa: E402
from replaygen.spec import load_spec  # noqa: E402

from conftest import DEVICE, ROOT  # noqa: E402

NEW_TOKENS = 32
COMMON = {"vocab_size": 64, "hidden_size": 32, "eos_token_id": None, "pad_token_id": 0, "bos_token_id": None, "initializer_range": 0.3}
ATTENTION = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
GDN = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}


def _mamba2():
    config = transformers.Mamba2Config(**COMMON, num_hidden_layers=2, state_size=16, expand=2, head_dim=16, num_heads=4, n_groups=2, conv_kernel=4, chunk_size=8)
    return transformers.Mamba2ForCausalLM(config)


def _nemotron_h():
    config = transformers.NemotronHConfig(
        **COMMON, **ATTENTION, num_hidden_layers=3, hybrid_override_pattern="M*-", mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
        ssm_state_size=16, conv_kernel=4, intermediate_size=64, chunk_size=8,
    )
    return transformers.NemotronHForCausalLM(config)


def _bamba():
    config = transformers.BambaConfig(
        **COMMON, **{k: v for k, v in ATTENTION.items() if k != "head_dim"}, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, intermediate_size=64, mamba_chunk_size=8,
    )
    return transformers.BambaForCausalLM(config)


def _qwen3_next():
    config = transformers.Qwen3NextConfig(
        **COMMON, **ATTENTION, **GDN, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )
    return transformers.Qwen3NextForCausalLM(config)


def _qwen3_5():
    config = transformers.Qwen3_5TextConfig(**COMMON, **ATTENTION, **GDN, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], intermediate_size=64)
    return transformers.Qwen3_5ForCausalLM(config)


def _falcon_h1():
    config = transformers.FalconH1Config(
        **COMMON, **ATTENTION, num_hidden_layers=2, intermediate_size=64, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
    )
    return transformers.FalconH1ForCausalLM(config)  # attention beside the mixer in every layer: one cache layer holds both


def _granitemoehybrid():
    config = transformers.GraniteMoeHybridConfig(
        **COMMON, **{k: v for k, v in ATTENTION.items() if k != "head_dim"}, num_hidden_layers=2, layer_types=["mamba", "attention"],
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
    )
    return transformers.GraniteMoeHybridForCausalLM(config)


def _zamba2():
    config = transformers.Zamba2Config(
        **COMMON, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2,
        n_mamba_heads=4, chunk_size=8, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, num_mem_blocks=1, use_mem_rope=False,
    )
    return transformers.Zamba2ForCausalLM(config)


def _kimi_linear():
    config = transformers.KimiLinearConfig(
        **COMMON, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
        n_group=1, topk_group=1,
    )
    return transformers.KimiLinearForCausalLM(config)


MODELS = {
    "mamba2": _mamba2,
    "nemotron_h": _nemotron_h,
    "bamba": _bamba,
    "falcon_h1": _falcon_h1,
    "granitemoehybrid": _granitemoehybrid,
    "zamba2": _zamba2,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "kimi_linear": _kimi_linear,
}


def _kernels(names, baseline) -> list[tuple[str, str]]:
    """(model, kernels) cases: every model of `names` on the replay kernels, those of `baseline` on the baseline
    kernels too (one Mamba-2 and one delta-rule model or so: the runtime's path is the family's in both)."""
    return [(name, "replay") for name in names] + [(name, "baseline") for name in baseline]


def _model(name: str):
    torch.manual_seed(0)
    return MODELS[name]().to(DEVICE).eval()


def _prompts() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(1, 64, (2, 7), generator=generator).to(DEVICE)


def _hf_greedy(model, prompts: torch.Tensor):
    out = model.generate(prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, prompts.shape[1] :], torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("name, kernels", _kernels(sorted(MODELS), ["nemotron_h", "qwen3_5", "kimi_linear"]))
def test_greedy_generation_is_hf_greedy_generation(name, kernels):
    """32 greedy tokens through the replay kernels (L=8: several flushes), or the baseline kernels, are HF's, each
    from logits within 1e-4."""
    model, prompts = _model(name), _prompts()
    tokens, logits = _hf_greedy(model, prompts)
    assert len(set(tokens[0].tolist())) > 4, "the random model repeats itself: the check would be weak"
    runtime = attach(model, capacity=8, window=4, kernels=kernels)
    assert runtime.layers, "no recurrent layer was attached"
    ours = runtime.generate(prompts, NEW_TOKENS)
    assert torch.equal(ours.tokens, tokens)
    torch.testing.assert_close(ours.logits, logits, atol=1e-4, rtol=1e-4)
    assert ours.steps == NEW_TOKENS - 1


def _drafts_right_up_to(greedy: torch.Tensor, prompt_lengths: list[int]):
    """A drafter that proposes greedy decoding's next tokens, but for one wrong draft whose place cycles through the
    window (every acceptance count from 0 to all occurs); the sequences it sees hold their prompts' real tokens."""

    def drafter(sequences, count):
        drafts = []
        for row, tokens in enumerate(sequences):
            done = len(tokens) - prompt_lengths[row]
            right = greedy[row, done : done + count].tolist()
            right += [0] * (count - len(right))
            wrong = done % (count + 1)
            if wrong < count:
                right[wrong] = (right[wrong] + 1) % 64
            drafts.append(right)
        return drafts

    return drafter


@pytest.mark.parametrize("name, kernels", _kernels(["mamba2", "qwen3_next", "falcon_h1"], ["mamba2", "qwen3_next"]))
def test_speculative_generation_gives_greedy_tokens_in_fewer_steps(name, kernels):
    """Windows of 4 verified and committed (the attention KV cropped after rejections), drafts accepted 0 to 3 at
    a time: the tokens and logits of greedy decoding, in fewer steps."""
    model, prompts = _model(name), _prompts()
    runtime = attach(model, capacity=8, window=4, kernels=kernels)
    greedy = runtime.generate(prompts, NEW_TOKENS)
    speculative = runtime.generate(prompts, NEW_TOKENS, draft_tokens=3, drafter=_drafts_right_up_to(greedy.tokens, [prompts.shape[1]] * 2))
    assert torch.equal(speculative.tokens, greedy.tokens)
    torch.testing.assert_close(speculative.logits, greedy.logits, atol=1e-4, rtol=1e-4)
    assert speculative.steps < (NEW_TOKENS - 1) / 2


@pytest.mark.parametrize("kernels, window", [("replay", 2), ("baseline", 4)])
def test_prompt_lookup_speculation_gives_greedy_tokens(kernels, window):
    """Prompt-lookup drafts in windows of 2 (one draft): greedy decoding's tokens; the baseline's snapshots of a
    window of 4 take the windows of 2 padded."""
    model, prompts = _model("bamba"), _prompts()
    runtime = attach(model, capacity=8, window=window, kernels=kernels)
    assert torch.equal(runtime.generate(prompts, 8, draft_tokens=1).tokens, runtime.generate(prompts, 8).tokens)


@pytest.mark.parametrize("name, kernels", _kernels(["nemotron_h", "qwen3_5", "kimi_linear"], ["nemotron_h", "qwen3_5"]))
def test_a_rejected_draft_leaves_the_states_as_if_it_never_ran(name, kernels):
    """verify of a window then commit of 2 of its 4 tokens: recurrent states, conv inputs, attention KV and the
    next logits as after decoding those 2 tokens alone."""
    model, prompts = _model(name), _prompts()
    runtime = attach(model, capacity=8, window=4, kernels=kernels)
    window = torch.randint(1, 64, (2, 4), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    stepped, verified = runtime.start(prompts), runtime.start(prompts)
    for _ in range(5):  # past the first flush of the decode path's buffer
        token = stepped.logits.argmax(-1)
        stepped.logits = stepped.decode(token)
        verified.logits = verified.decode(token)
    for t in range(2):
        after_decode = stepped.decode(window[:, t])
    logits = verified.verify(window)
    torch.testing.assert_close(logits[:, 1], after_decode, atol=1e-4, rtol=1e-4)
    verified.commit(2)
    for index, (state, conv) in stepped.states().items():
        other_state, other_conv = verified.states()[index]
        torch.testing.assert_close(other_state, state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(other_conv, conv, atol=1e-6, rtol=1e-5)  # projections of 1 and 4 tokens: last bits differ
    next_token = window[:, 2]
    torch.testing.assert_close(verified.decode(next_token), stepped.decode(next_token), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["mamba2", "qwen3_next"])
def test_prompts_of_different_lengths_decode_as_in_hf(name):
    """Left-padded prompts (lengths 7 and 4) with their attention mask: HF generate's tokens, greedy and speculative."""
    model, prompts = _model(name), _prompts()
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    prompts = prompts.masked_fill(mask == 0, 0)
    out = model.generate(prompts, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    runtime = attach(model, capacity=8, window=4)
    assert torch.equal(runtime.generate(prompts, 16, attention_mask=mask).tokens, out[:, prompts.shape[1] :])
    drafter = _drafts_right_up_to(out[:, prompts.shape[1] :], mask.sum(dim=1).tolist())
    speculative = runtime.generate(prompts, 16, draft_tokens=3, drafter=drafter, attention_mask=mask)
    assert torch.equal(speculative.tokens, out[:, prompts.shape[1] :])
    with pytest.raises(ValueError, match="padding must be on the left"):
        runtime.start(prompts, attention_mask=mask.flip(1))


def test_the_cpu_example_runs():
    """examples/hf_on_cpu.py, as the README runs it."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_on_cpu.py")], capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "24 greedy tokens as HF's: True; speculative: the same tokens True" in done.stdout


def test_the_e2e_tokens_script_runs_on_the_cpu(tmp_path, monkeypatch):
    """docs/experiments/e2e_tokens.py: --help without importing torch; a tiny Nemotron-H through HF's path and
    replay speculation in windows of 2 under the interpreter, the rows in its JSON, the tokens HF's."""
    script = ROOT / "docs" / "experiments" / "e2e_tokens.py"
    no_torch = "import sys, runpy; sys.modules['torch'] = None; sys.argv = [sys.argv[1], '--help']; runpy.run_path(sys.argv[0], run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", no_torch, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--repeat-prompt" in done.stdout, done.stderr[-2000:]
    spec = importlib.util.spec_from_file_location("e2e_tokens", script)
    e2e = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, e2e)  # where its dataclasses look their module up
    spec.loader.exec_module(e2e)
    out = tmp_path / "e2e.json"
    argv = ["--tiny", "--device", "cpu", "--dtype", "float32", "--models", "nemotron_h", "--paths", "replay-t2,hf", "--batch", "2", "--layers", "1"]
    e2e.main([*argv, "--new-tokens", "2", "--prompt-tokens", "8", "--repeats", "1", "--share-steps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [row["path"] for row in rows] == ["hf", "replay-t2"]
    assert rows[1]["same_as_hf"] == 1.0 and rows[1]["tokens_per_step"] >= 1 and 0 < rows[1]["recurrent_share"] <= 1


def test_misuse_is_refused_with_a_clear_error():
    model, prompts = _model("mamba2"), _prompts()
    runtime = attach(model, capacity=8, window=4)
    with pytest.raises(ValueError, match="at most 3 drafts"):
        runtime.generate(prompts, 4, draft_tokens=4)
    session = runtime.start(prompts)
    with pytest.raises(ReplaygenError, match="commit without a verify"):
        session.commit(1)
    session.verify(prompts[:, :3])
    with pytest.raises(ReplaygenError, match="not committed"):
        session.decode(prompts[:, 0])
    with pytest.raises(ValueError, match="keep 1..3"):
        session.commit(4)
    with pytest.raises(ValueError, match="verify takes 1..4"):
        session.commit(1) or session.verify(torch.cat([prompts, prompts], dim=1))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, **ATTENTION, num_hidden_layers=1, intermediate_size=64))
    with pytest.raises(ReplaygenError, match="no recurrent mixer"):
        attach(llama)
    with pytest.raises(ValueError, match="kernels='snapshots': one of 'replay', 'baseline'"):
        attach(model, kernels="snapshots")


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert prompt_lookup([5, 6, 7, 5, 6], 2) == [7, 5]  # the bigram (5, 6) matched, its followers taken
    assert prompt_lookup([4, 8, 4], 3) == [8, 4, 4]  # fewer followers than asked: the last one repeated
    assert prompt_lookup([1, 2, 3], 2) == [3, 3]  # no match: the last token repeated


def test_a_layer_of_a_shipped_shape_runs_its_tuned_module():
    """attach with gpu: a mixer of Nemotron-H's sizes at L=16, T=4 gets the module `replaygen build` bakes for the
    shipped nemotron-h shape; another L gets the documented defaults (a model of meta tensors: nothing runs)."""
    config = transformers.NemotronHConfig(
        vocab_size=64, hidden_size=256, num_hidden_layers=1, hybrid_override_pattern="M", num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, intermediate_size=64,
    )
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(config)
    tuned = open(attach(model, capacity=16, window=4, gpu="H200").layers[0].module.__file__).read()
    shipped = (ROOT / "generated" / "h200" / "mamba2_nemotron_h.py").read_text()
    configs = [line for line in shipped.splitlines() if line.startswith("# configs")]
    assert configs and configs[0] in tuned.splitlines()
    assert _tables(tuned) == _tables(shipped)
    assert "def conv(" in tuned and "def conv(" not in shipped  # the model's conv beside the shipped kernels
    other = attach(model, capacity=12, window=4, gpu="h200").layers[0].module
    assert "# configs    defaults" in open(other.__file__).read()


def test_a_shipped_shape_in_the_other_state_layout_runs_transposed(monkeypatch):
    """attach with gpu: where the shipped shape of a mixer's sizes stores the state [value, key] (vLLM's layout, the
    shipped GDN shapes') and HF keeps [key, value], the layer runs that shape's module with the states transposed at
    load and at `states`: greedy tokens as HF's, states in HF's layout."""
    from replaygen.integrations import transformers as integration
    from replaygen.paths import spec_file

    model, prompts = _model("qwen3_5"), _prompts()
    mixer, family = integration.recurrent_mixers(model)[0]
    entry = dict(family.shape_entry(mixer), capacity=8, window=4, layout="value_key")
    shipped_shape = integration.model_spec("gdn", integration.mixer_conv(family, mixer), {"tiny-value-key": entry}, "the test").shapes[0]
    gdn = load_spec(spec_file("gdn"))
    monkeypatch.setattr(integration, "load_spec", lambda path: dataclasses.replace(gdn, shapes=(shipped_shape,)))
    runtime = attach(model, capacity=8, window=4, gpu="h200")
    assert [layer.transposed for layer in runtime.layers] == [True]
    assert "tiny-value-key" in open(runtime.layers[0].module.__file__).read()
    tokens, _ = _hf_greedy(model, prompts)
    assert torch.equal(runtime.generate(prompts, NEW_TOKENS).tokens, tokens)
    session = runtime.start(prompts)
    index = runtime.layers[0].index
    torch.testing.assert_close(session.states()[index][0], session.cache.get_recurrent_state(index).float(), atol=1e-6, rtol=1e-6)


def _tables(source: str) -> list[str]:
    """The dispatch tables of a generated module's source, one block of lines each."""
    tables, current = [], None
    for line in source.splitlines():
        if line.startswith("_") and line.endswith("_CONFIGS = ("):
            current = [line]
        elif current is not None:
            current.append(line)
            if line == ")":
                tables.append("\n".join(current))
                current = None
    assert tables, "no dispatch table found"
    return tables


def test_spec_from_config_writes_a_spec_that_builds(tmp_path):
    """`replaygen spec-from-config` of a saved config: the shipped spec with the model's layer shapes, which
    `replaygen build` builds; a folder without a config, or a model without a recurrent mixer, is refused."""
    _model("qwen3_next").config.save_pretrained(tmp_path / "model")
    spec_path = tmp_path / "qwen3-next.yaml"
    assert main(["spec-from-config", str(tmp_path / "model"), "--out", str(spec_path), "--capacity", "8"]) == 0
    spec = load_spec(spec_path)
    assert spec.name == "gdn" and [s.name for s in spec.shapes] == ["qwen3-next"]
    assert (spec.conv.width, spec.conv.activation.value, [c.value for c in spec.conv.channels]) == (4, "silu", ["query", "key", "value"])
    shape = spec.shapes[0]
    assert (shape.heads, shape.key_heads, shape.value_dim, shape.key_dim, shape.capacity, shape.window, shape.layout.value) == (4, 2, 16, 16, 8, 4, "key_value")
    assert main(["build", str(spec_path), "--gpu", "cpu", "--allow-default", "--out", str(tmp_path / "kernels")]) == 0
    assert (tmp_path / "kernels" / "cpu" / "gdn_qwen3_next.py").is_file()
    assert main(["spec-from-config", str(tmp_path), "--out", str(tmp_path / "x.yaml")]) == 2
    transformers.LlamaConfig(**COMMON, **ATTENTION, num_hidden_layers=1, intermediate_size=64).save_pretrained(tmp_path / "llama")
    assert main(["spec-from-config", str(tmp_path / "llama"), "--out", str(tmp_path / "x.yaml")]) == 2
    assert not (tmp_path / "x.yaml").exists()


def test_an_older_transformers_is_named(monkeypatch):
    """transformers before 5.25 has no replacement points for the Mamba-2 conv and scan: attach says so instead of
    finding no recurrent mixer."""
    model = _model("mamba2")
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.17.0")  # the module a model's import left there
    with pytest.raises(ReplaygenError, match=r"needs transformers >= 5.25 .* this Python has 5.17.0"):
        attach(model, capacity=8, window=2)


REAL_SIZES = {
    # Nemotron-H's Mamba-2 mixer (128 heads of 64, 8 groups, state 128) and one attention layer
    "nemotron_h": lambda: transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        vocab_size=1024, hidden_size=4096, num_hidden_layers=3, hybrid_override_pattern="M*M", num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, intermediate_size=1024,
        eos_token_id=None, pad_token_id=0, bos_token_id=None,
    )),
    # Qwen3-Next's Gated DeltaNet (32 value heads, 16 key heads, 128 x 128) and one attention layer
    "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        vocab_size=1024, hidden_size=2048, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, intermediate_size=1024, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, eos_token_id=None, pad_token_id=0, bos_token_id=None,
    )),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(REAL_SIZES))
def test_real_layer_sizes_on_the_gpu(name):
    """Random weights at real layer sizes (float32, batch 4, L=28, T=4 with the shipped -mtp shapes' tuned
    kernels where the sizes match): greedy tokens as HF's generate, speculation giving them too."""
    torch.manual_seed(0)
    model = REAL_SIZES[name]().to("cuda").eval()
    prompts = torch.randint(1, 1024, (4, 16), generator=torch.Generator().manual_seed(1)).to("cuda")
    tokens, logits = _hf_greedy(model, prompts)
    runtime = attach(model, capacity=28, window=4, gpu="h200")
    ours = runtime.generate(prompts, NEW_TOKENS)
    assert torch.equal(ours.tokens, tokens)
    torch.testing.assert_close(ours.logits, logits, atol=2e-3, rtol=2e-3)
    speculative = runtime.generate(prompts, NEW_TOKENS, draft_tokens=3, drafter=_drafts_right_up_to(tokens, [prompts.shape[1]] * 4))
    assert torch.equal(speculative.tokens, tokens)
