#!/usr/bin/env python3
"""Reference fixtures from Hugging Face transformers, for the tests of ferrotron's model math
against an implementation it does not share. Run by hand, not by CI:

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.15.0 transformers==5.24.0 safetensors==0.8.0
    /tmp/hf/bin/python scripts/hf-fixtures.py crates/train/tests/fixtures/hf [NAME...]

For each tiny random model it writes NAME/ with
  - the model as transformers saves it (config.json, model.safetensors; llama32_sharded/ is
    the Llama-3.2-style model again in 100 KB shards with model.safetensors.index.json),
  - reference.safetensors: `stream` (b·s + 1 tokens), cut into the windows `input_ids` and
    `targets` ([b, s] int64, stride s, as ferrotron cuts a token file), `prompt` (the first 5
    input ids) and `generated` (the 12 tokens greedy `generate` continues it with), the per-position
    `logits` ([b, s, vocab], f32), `loss` (f64: mean next-token cross-entropy over the b·s
    positions) and `grad.<parameter name>` (f32) for every parameter,
computed in float64 from the saved f32 weights (so the reference carries no f32 rounding).
"""
import os
import sys

import torch
import transformers
from safetensors.torch import save_file

assert torch.__version__.startswith("2.15.0"), torch.__version__
assert transformers.__version__ == "5.24.0", transformers.__version__

BATCH, SEQ = 2, 16


def llama32():
    # Llama-3.2 style: tied embeddings, grouped-query attention, llama3 rope scaling (an
    # original context of 16 puts the tiny head's frequencies in all three bands).
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
    )


def llama_untied():
    # Untied, and a head dimension (16) other than hidden / heads (8): q_proj is [96, 48].
    return transformers.LlamaConfig(
        vocab_size=80, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=16, max_position_embeddings=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def mixtral():
    return transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=None, router_aux_loss_coef=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def qwen2():
    # Qwen2: biases on the q, k and v projections (none on o_proj or the MLP), GQA, no sliding
    # window.
    return transformers.Qwen2Config(
        vocab_size=72, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


MODELS = {"llama32": (llama32, transformers.LlamaForCausalLM),
          "llama_untied": (llama_untied, transformers.LlamaForCausalLM),
          "mixtral": (mixtral, transformers.MixtralForCausalLM),
          "qwen2": (qwen2, transformers.Qwen2ForCausalLM)}


def saved_names(name, grad):
    """The gradient of parameter `name` under the names the saved file uses: transformers 5
    fuses a Mixtral block's experts in memory (`mlp.experts.gate_up_proj` [E, 2F, H] holding
    w1 then w3, `mlp.experts.down_proj` [E, H, F] = w2) and saves them one by one."""
    if ".mlp.experts.gate_up_proj" in name:
        base = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
        f = grad.shape[1] // 2
        for e in range(grad.shape[0]):
            yield f"{base}.{e}.w1.weight", grad[e, :f]
            yield f"{base}.{e}.w3.weight", grad[e, f:]
    elif ".mlp.experts.down_proj" in name:
        base = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
        for e in range(grad.shape[0]):
            yield f"{base}.{e}.w2.weight", grad[e]
    elif ".mlp.gate.weight" in name and "experts" not in name and grad.dim() == 2 and "mixtral" in CURRENT:
        yield name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight"), grad
    else:
        yield name, grad


CURRENT = ""


def build(name, out_root):
    global CURRENT
    CURRENT = name
    make_config, cls = MODELS[name]
    torch.manual_seed(1234)
    config = make_config()
    model = cls(config).to(torch.float32)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # float64 has no grouped matmul
    model.config._attn_implementation = "eager"
    # Larger than the default init (std 0.02) so every gradient stands well above rounding.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # Biases too (transformers starts them at zero), so the forward tests them.
            if p.dim() > 1 or pname.endswith(".bias"):
                p.normal_(0.0, 0.2)
    out = os.path.join(out_root, name)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if name == "llama32":
        # The same model in shards of at most 100 KB with their index, as transformers shards
        # every model above its max_shard_size.
        model.save_pretrained(out + "_sharded", safe_serialization=True, max_shard_size="100KB")
        os.remove(os.path.join(out + "_sharded", "generation_config.json"))
    for extra in ["generation_config.json"]:
        path = os.path.join(out, extra)
        if os.path.exists(path):
            os.remove(path)

    g = torch.Generator().manual_seed(7)
    # One stream of BATCH·SEQ + 1 tokens cut into BATCH windows of SEQ + 1 with stride SEQ,
    # as ferrotron cuts a token file: a file holding the stream gives the trainer this batch.
    stream = torch.randint(0, config.vocab_size, (BATCH * SEQ + 1,), generator=g)
    windows = torch.stack([stream[i * SEQ:(i + 1) * SEQ + 1] for i in range(BATCH)])
    inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    # Greedy continuation of the first sequence's first 5 tokens, as transformers generates
    # it (do_sample=False), in float32 like the engine.
    # (no end-of-sequence token: 12 tokens whatever they are).
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    prompt = inputs[:1, :5].clone()
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False)
    ref = model.to(torch.float64)
    ref.zero_grad()
    logits = ref(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, config.vocab_size), targets.reshape(-1))
    loss.backward()
    tensors = {"stream": stream.contiguous(), "input_ids": inputs, "targets": targets,
               "logits": logits.detach().to(torch.float32).contiguous(),
               "loss": loss.detach().reshape(1),
               "prompt": prompt.contiguous(),
               "generated": generated[:, prompt.shape[1]:].contiguous()}
    for pname, p in ref.named_parameters():
        for saved, grad in saved_names(pname, p.grad):
            tensors["grad." + saved] = grad.to(torch.float32).contiguous()
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    print(f"{name}: loss {loss.item():.6f}, {sum(p.numel() for p in ref.parameters())} parameters")


if __name__ == "__main__":
    # scripts/hf-fixtures.py [ROOT [NAME...]]: every model, or the ones named.
    root = sys.argv[1] if len(sys.argv) > 1 else "crates/train/tests/fixtures/hf"
    for name in sys.argv[2:] or MODELS:
        build(name, root)
