import pytest
import torch

from lab.model import MODEL_SIZES, ModelConfig, TransformerLM, config_for
from lab.model.attention import attention_names, causal_mask, get_attention


def closed_form_params(d, f, layers, vocab=10_000):
    per_block = 4 * d * d + 3 * d * f + 2 * d  # q,k,v,o; w1,w2,w3; two RMSNorm weights
    return 2 * vocab * d + layers * per_block + d  # embedding + untied head + blocks + final norm


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_parameter_count_matches_closed_form(size):
    cfg = config_for(size)
    with torch.device("meta"):
        model = TransformerLM(cfg)
    assert model.num_parameters() == closed_form_params(cfg.d_model, cfg.d_ff, cfg.num_layers)


def test_spec_sizes_and_alias():
    assert MODEL_SIZES["2.7B"] == dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32)
    assert MODEL_SIZES["xl"] == dict(d_model=1600, d_ff=6400, num_layers=48, num_heads=25)
    assert config_for("2.7b").d_model == 2560
    with pytest.raises(ValueError, match="unknown model size"):
        config_for("huge")
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, d_ff=64, num_layers=1, num_heads=4)


def tiny(attention="sdpa", **kw):
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, context_length=24,
                                     vocab_size=50, attention=attention, **kw))


def test_output_shape_and_dtype():
    model = tiny()
    logits = model(torch.randint(0, 50, (3, 17)))
    assert logits.shape == (3, 17, 50) and logits.dtype == torch.float32


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_causal_future_tokens_do_not_change_past_logits(attention):
    model = tiny(attention)
    x = torch.randint(0, 50, (2, 20))
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 7) % 50
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3


def test_naive_and_sdpa_agree_with_float64_reference():
    q, k, v = (torch.randn(2, 3, 10, 8, dtype=torch.float64) for _ in range(3))
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(scores, -1) @ v
    for name in ("naive", "sdpa"):
        torch.testing.assert_close(get_attention(name)(q, k, v, True), ref)


def test_rope_makes_scores_depend_on_relative_position():
    model = tiny()
    rope = model.blocks[0].attn.rope
    q = torch.randn(1, 1, 1, 8).expand(1, 1, 20, 8).contiguous()
    k = torch.randn(1, 1, 1, 8).expand(1, 1, 20, 8).contiguous()
    s = rope(q)[0, 0] @ rope(k)[0, 0].T  # s[i, j] must depend on i - j only
    torch.testing.assert_close(s[5, 2], s[15, 12], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s[3, 3], s[19, 19], rtol=1e-5, atol=1e-5)


def test_errors_for_unknown_attention_and_long_input():
    with pytest.raises(ValueError, match="unknown attention"):
        tiny("nope")
    with pytest.raises(ValueError, match="context length"):
        tiny()(torch.randint(0, 50, (1, 30)))


def test_naive_attention_compiles_to_one_graph():
    # the profiler/NVTX ranges must not break torch.compile's graph capture
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    compiled = torch.compile(get_attention("naive"), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, True), get_attention("naive")(q, k, v, True))


def _reference_attention(q, k, v, causal):
    """float64 textbook attention with the top-left causal mask (query i sees keys 0..i)."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        future = torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("n_q,n_k", [(3, 5), (5, 3), (7, 7)])
@pytest.mark.parametrize("name", ["naive", "sdpa", "sdpa_math", "flash_pytorch", "flash_triton"])
def test_every_registered_attention_uses_the_top_left_causal_convention(name, n_q, n_k):
    """One causal convention for every implementation, also with n_queries != n_keys (the case where
    bottom-right and top-left alignment differ)."""
    gen = torch.Generator().manual_seed(n_q * 10 + n_k)
    dtype = torch.float32 if name == "flash_triton" else torch.float64
    q = torch.randn(1, 2, n_q, 16, generator=gen, dtype=dtype)
    k, v = (torch.randn(1, 2, n_k, 16, generator=gen, dtype=dtype) for _ in range(2))
    for causal in (False, True):
        got = get_attention(name)(q, k, v, causal)
        ref = _reference_attention(q.double(), k.double(), v.double(), causal)
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_causal_mask_is_top_left():
    assert causal_mask(3, 5).tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                                          [True, True, True, False, False]]
    assert set(attention_names()) >= {"naive", "sdpa", "flash_triton", "flash_pytorch", "sdpa_cudnn"}
