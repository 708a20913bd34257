"""A tiny randomly initialised HF Nemotron-H (Mamba-2 and attention layers) decoding through replaygen on the CPU:
greedy tokens as HF's own `generate` gives them, then the same tokens with prompt-lookup speculation.

    pip install -e '.[transformers]'
    python examples/hf_on_cpu.py

Triton's interpreter runs the kernels with numpy (slowly, about a minute); on a GPU, drop TRITON_INTERPRET and move
the model to "cuda".
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import transformers  # noqa: E402

from replaygen.integrations.transformers import attach  # noqa: E402

torch.manual_seed(0)
config = transformers.NemotronHConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=3, hybrid_override_pattern="M*M", num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, intermediate_size=64,
    initializer_range=0.3, eos_token_id=None, pad_token_id=0, bos_token_id=None,
)
model = transformers.NemotronHForCausalLM(config).eval()
prompts = torch.randint(1, 64, (2, 7))
hf = model.generate(prompts, max_new_tokens=24, min_new_tokens=24, do_sample=False)[:, prompts.shape[1] :]

runtime = attach(model, capacity=8, window=4)  # L=8: the replay buffers flush every 8 tokens
greedy = runtime.generate(prompts, 24)
speculative = runtime.generate(prompts, 24, draft_tokens=3)
print(f"{len(runtime.layers)} Mamba-2 layers on replay kernels; 24 greedy tokens as HF's: {torch.equal(greedy.tokens, hf)}; "
      f"speculative: the same tokens {torch.equal(speculative.tokens, hf)} in {speculative.steps} steps")
assert torch.equal(greedy.tokens, hf) and torch.equal(speculative.tokens, hf)
