"""A Hugging Face model as a flexsearch model file: a Llama built from its config
(nothing downloaded; on the meta device, so planning needs no memory for it), trained on
its own loss: given ``labels``, ``LlamaForCausalLM`` shifts them and returns the loss.

    flexsearch plan examples/hf_llama.py --devices 8 --cluster dgx-h100

``use_cache`` is left at its default: the tracer turns it off for the trace and says so.
"""

import torch
import transformers


def build_model(batch_size: int = 16, seq_len: int = 1024):
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=seq_len)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    return model, (ids, {"labels": ids})
