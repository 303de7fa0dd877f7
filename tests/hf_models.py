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
    if name in MORE_NAMES:
        return _more(tf, name)
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


MORE_NAMES = ("phi3", "phi", "gpt_neox", "opt", "gemma2", "gemma3", "qwen3", "olmo2", "stablelm", "starcoder2",
              "gptj", "bloom", "gpt_bigcode", "distilbert", "deberta_v2", "electra", "swin", "deepseek_v3")
"""More families, checked behind the ``slow`` marker
(``tests/test_hf.py::test_more_families_trace_plan_and_verify``)."""


def _more(tf, name: str):
    """``(model, example_inputs)`` of one of :data:`MORE_NAMES`, dropout off."""
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    gqa = dict(common, num_key_value_heads=2)
    decoders = {
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(gqa, resid_pdrop=0.0, embd_pdrop=0.0)),
        "phi": (tf.PhiConfig, tf.PhiForCausalLM, dict(common, resid_pdrop=0.0, embd_pdrop=0.0)),
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict(common, hidden_dropout=0.0)),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(gqa, head_dim=16)),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(gqa, head_dim=16)),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(gqa, head_dim=16)),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, gqa),
        "stablelm": (tf.StableLmConfig, tf.StableLmForCausalLM, dict(gqa, hidden_dropout=0.0)),
        "starcoder2": (tf.Starcoder2Config, tf.Starcoder2ForCausalLM,
                       dict(gqa, residual_dropout=0.0, embedding_dropout=0.0)),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                        dict(common, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                             qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1)),
    }
    torch.manual_seed(0)
    if name in decoders:
        c, m, kw = decoders[name]
        return m(c(**kw)), (_ids(),)
    gpt = dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0)
    others = {
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=V, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                      num_attention_heads=4, max_position_embeddings=64,
                                                      word_embed_proj_dim=64, dropout=0.0)),
        "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(**gpt, rotary_dim=8, bos_token_id=1, eos_token_id=2)),
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=V, hidden_size=64, n_layer=2, n_head=4,
                                                            hidden_dropout=0.0, attention_dropout=0.0)),
        "gpt_bigcode": lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(**gpt, bos_token_id=1, eos_token_id=2)),
        "distilbert": lambda: tf.DistilBertForMaskedLM(tf.DistilBertConfig(
            vocab_size=V, dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0, attention_dropout=0.0,
            max_position_embeddings=64)),
        "deberta_v2": lambda: tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(
            vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "electra": lambda: tf.ElectraForMaskedLM(tf.ElectraConfig(
            vocab_size=V, embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    }
    if name in others:
        return others[name](), (_ids(),)
    if name == "swin":
        cfg = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                            num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            drop_path_rate=0.0)
        return tf.SwinForImageClassification(cfg), (torch.randn(B, 3, 32, 32),)
    raise KeyError(name)
