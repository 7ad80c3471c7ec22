"""The Transformer Engine stand-in (te_standin.py) against TE itself: the names, signature
and state semantics it mirrors are read from the ``transformer-engine`` 2.20.2 wheel's
Python source (scripts/test.sh downloads it; ``HAPO_TE_WHEEL``), the switch it flips is read
from megatron-core's source, and its update is TE's kernel formula."""

import ast
import inspect
import os
import zipfile

import pytest
import torch

from .te_standin import TE_VERSION, FusedAdam

WHEEL = os.environ.get("HAPO_TE_WHEEL")


def _te_source(path: str) -> ast.Module:
    if not WHEEL:
        pytest.skip("no transformer-engine wheel (set HAPO_TE_WHEEL; scripts/test.sh downloads it)")
    assert TE_VERSION in os.path.basename(WHEEL), (WHEEL, TE_VERSION)
    with zipfile.ZipFile(WHEEL) as z:
        return ast.parse(z.read(path).decode())


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_stand_in_mirrors_te_fused_adam_source():
    tree = _te_source("transformer_engine/pytorch/optimizers/fused_adam.py")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FusedAdam")
    assert ast.unparse(cls.bases[0]) == "torch.optim.Optimizer"
    # the constructor's parameters, names and order (positional and keyword-only)
    init = _method(cls, "__init__")
    te_params = [a.arg for a in init.args.args + init.args.kwonlyargs]
    ours = [n for n in inspect.signature(FusedAdam.__init__).parameters]
    assert ours == te_params, (ours, te_params)
    # the per-parameter state a FusedAdam knows: exactly these three names
    maps = [n for n in ast.walk(init) if isinstance(n, ast.Assign)
            and ast.unparse(n.targets[0]) == "self.name_to_dtype_map"]
    assert len(maps) == 1 and {k.value for k in maps[0].value.keys} == {"exp_avg", "exp_avg_sq", "master_param"}
    assert set(FusedAdam([torch.nn.Parameter(torch.ones(1))]).name_to_dtype_map) == {k.value for k in maps[0].value.keys}
    # get_unscaled_state indexes that map with the key it is given (any other key: KeyError)
    gus = ast.unparse(_method(cls, "get_unscaled_state"))
    assert "self.name_to_dtype_map[state_name]" in gus
    # state_dict sends every per-parameter key through get_unscaled_state; load_state_dict through set_scaled_state
    sd = ast.unparse(_method(cls, "state_dict"))
    assert "for name in v:" in sd and "self.get_unscaled_state(param, name)" in sd
    lsd = ast.unparse(_method(cls, "load_state_dict"))
    assert "for name in v:" in lsd and "self.set_scaled_state(param, name" in lsd
    # the step lives in the param group
    step = ast.unparse(_method(cls, "step"))
    assert "group['step'] += " in step and "group['step'] = " in step
    assert "self.initialize_state(p" in step
    # the package exports it where megatron-core imports it from
    init_py = ast.unparse(_te_source("transformer_engine/pytorch/optimizers/__init__.py"))
    assert "from .fused_adam import FusedAdam" in init_py


def test_megatron_core_switches_on_te_where_the_stand_in_does():
    """The globals ``use_te_fused_adam`` sets are the ones megatron-core's optimizer modules
    set from ``from transformer_engine.pytorch.optimizers import FusedAdam``."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.distrib_optimizer as dopt

    src_init, src_dist = inspect.getsource(mopt), inspect.getsource(dopt)
    te_import = "from transformer_engine.pytorch.optimizers import FusedAdam as Adam"
    assert te_import in src_init and te_import in src_dist
    block = src_init[src_init.index(te_import):src_init.index("except ImportError")]
    assert "USING_PYTORCH_OPTIMIZER = False" in block
    block = src_dist[src_dist.index(te_import):src_dist.index("except ImportError")]
    assert "USING_TE_OPTIMIZER = True" in block
    assert all(hasattr(dopt, n) for n in ("HAVE_APEX_OR_TE", "USING_TE_OPTIMIZER", "Adam"))
    assert all(hasattr(mopt, n) for n in ("USING_PYTORCH_OPTIMIZER", "Adam"))


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_the_update_is_te_kernel_formula(adam_w_mode):
    """TE's ``adam_update`` (transformer_engine/common/multi_tensor/adam.cu), step by step by
    hand in float64; with decoupled decay it is torch's AdamW too."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(5, generator=g)
    grads = [torch.randn(5, generator=g) for _ in range(3)]
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.99, 1e-6, 0.1
    p = torch.nn.Parameter(p0.clone())
    opt = FusedAdam([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adam_w_mode=adam_w_mode)
    want, m, v = p0.double().clone(), torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for t, gr in enumerate(grads, 1):
        p.grad = gr.clone()
        opt.step()
        gg = gr.double() + (0 if adam_w_mode else wd * want)
        m, v = b1 * m + (1 - b1) * gg, b2 * v + (1 - b2) * gg * gg
        update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + (wd * want if adam_w_mode else 0)
        want = want - lr * update
    torch.testing.assert_close(p.detach().double(), want, rtol=0, atol=1e-6)
    assert opt.param_groups[0]["step"] == 3
    if adam_w_mode:
        q = torch.nn.Parameter(p0.clone())
        ref = torch.optim.AdamW([q], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        for gr in grads:
            q.grad = gr.clone()
            ref.step()
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)


def test_what_the_stand_in_does_not_cover_is_refused():
    p = [torch.nn.Parameter(torch.ones(2))]
    for kw in ({"master_weights": True}, {"capturable": True}, {"exp_avg_dtype": torch.bfloat16},
               {"store_param_remainders": True}):
        with pytest.raises(NotImplementedError, match="fp32 states only"):
            FusedAdam(p, **kw)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
