"""Hugging Face ``transformers`` models built from small configs (nothing downloaded),
each with example inputs as a user would call it. Shared by the tests that trace, plan
and emit them. Dropout is off (the configs' defaults are 0.1 for GPT-2, BERT, T5...):
the emitted model's random masks on its half of the batch cannot equal the reference's,
so an exact comparison needs it off."""

from __future__ import annotations

import torch

V, T, B = 256, 16, 4


def _ids(b: int = B, t: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (b, t), generator=g)


def _decoder(cfg_cls, model_cls, **extra):
    def build():
        torch.manual_seed(0)
        cfg = cfg_cls(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
        return model_cls(cfg), (_ids(),)
    return build


def build(name: str):
    """``(model, example_inputs)`` for the model named ``name`` (:data:`NAMES`)."""
    import transformers as tf

    if name == "gpt2":
        torch.manual_seed(0)
        cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=64, bos_token_id=1,
                            eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg), (_ids(),)
    decoders = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 16}),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                      {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 64}),
    }
    if name in decoders:
        c, m, extra = decoders[name]
        return _decoder(c, m, **extra)()
    torch.manual_seed(0)
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        return tf.BertModel(cfg), (_ids(), {"attention_mask": torch.ones(B, T, dtype=torch.long)})
    if name == "roberta":
        cfg = tf.RobertaConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=72, pad_token_id=0,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return tf.RobertaForMaskedLM(cfg), (_ids(),)
    if name == "t5":
        cfg = tf.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                          decoder_start_token_id=0, dropout_rate=0.0)
        return tf.T5ForConditionalGeneration(cfg), (_ids(), {"decoder_input_ids": _ids(B, 8)})
    if name == "bart":
        cfg = tf.BartConfig(vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0)
        return tf.BartForConditionalGeneration(cfg), (_ids(), {"decoder_input_ids": _ids(B, 8),
                                                             "attention_mask": torch.ones(B, T, dtype=torch.long)})
    if name == "falcon":  # not in NAMES: its attention builds a constant in forward (a test of its own)
        cfg = tf.FalconConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              hidden_dropout=0.0, attention_dropout=0.0)
        return tf.FalconForCausalLM(cfg), (_ids(),)
    if name == "vit":
        cfg = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
        return tf.ViTForImageClassification(cfg), (torch.randn(B, 3, 32, 32),)
    if name == "resnet":
        cfg = tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
        return tf.ResNetForImageClassification(cfg), (torch.randn(B, 3, 32, 32),)
    if name == "convnext":
        cfg = tf.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
        return tf.ConvNextForImageClassification(cfg), (torch.randn(B, 3, 32, 32),)
    raise KeyError(name)


NAMES = ("gpt2", "llama", "mistral", "qwen2", "gemma", "mixtral", "qwen2_moe", "bert", "roberta", "t5", "bart",
         "vit", "resnet", "convnext")
