"""Activation offloading inside lab.FSDP (2 gloo ranks): FSDP's hooks still take the gathered weights
(``delegate``), gradients equal FSDP's without offloading bit for bit, and the bytes offloaded are the
activations the same model saves without FSDP."""

import copy

import torch
import torch.nn.functional as F

from lab.model.offload import activation_offloading
from lab.model.transformer import ModelConfig, TransformerLM
from lab.parallel import launcher as distributed
from lab.parallel.fsdp import FSDP

VOCAB = 64
CFG = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, context_length=16, vocab_size=VOCAB)


def _loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def _worker() -> dict:
    torch.use_deterministic_algorithms(True)
    r = distributed.rank()
    torch.manual_seed(0)
    base = TransformerLM(CFG)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(r))
    x, y = tokens[:, :-1], tokens[:, 1:]
    plain = FSDP(copy.deepcopy(base))
    _loss(plain, x, y).backward()
    offloaded = FSDP(copy.deepcopy(base))
    with activation_offloading(offloaded.module, offload_blocks=range(CFG.num_layers), min_bytes=0,
                               delegate=offloaded.saved_tensor_hooks()) as off:
        _loss(offloaded, x, y).backward()
        inside = offloaded.gather_full_grads()  # the offload wrappers still stand around the blocks
    alone = copy.deepcopy(base)
    with activation_offloading(alone, offload_blocks=range(CFG.num_layers), min_bytes=0) as off_alone:
        _loss(alone, x, y).backward()
    g_plain, g_off = plain.gather_full_grads(), offloaded.gather_full_grads()
    return {"grads_equal": all(torch.equal(g_plain[k], g_off[k]) for k in g_plain),
            "named_as_wrapped": inside.keys() == g_plain.keys()
            and all(torch.equal(inside[k], g_plain[k]) for k in g_plain),
            "bytes": off.stats().bytes_offloaded, "bytes_alone": off_alone.stats().bytes_offloaded,
            "live_after": offloaded.live_gathered(), "max_live": (plain.max_live_gathered, offloaded.max_live_gathered)}


def test_offloading_inside_fsdp_is_exact_and_leaves_gathered_weights_to_fsdp():
    for res in distributed.launch(_worker, 2, device="cpu", timeout_s=120):
        assert res["grads_equal"]
        assert res["named_as_wrapped"]  # full gradients under the names FSDP wrapped, wrappers or not
        assert res["bytes"] == res["bytes_alone"] > 0  # no gathered weight travelled to the host
        assert res["live_after"] == 0
        assert res["max_live"][1] == res["max_live"][0]  # FSDP frees and regathers as without offloading
