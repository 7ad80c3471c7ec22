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


# ---------------------------------------------------------------- the layer-spec stand-in (te_stub/)
import contextlib  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402

from ._dist import TE_STUB  # noqa: E402


@contextlib.contextmanager
def te_stub():
    """The stand-in package imported as ``transformer_engine`` for the block, then removed from
    ``sys.modules`` and the path again (a megatron-core module imported later in this process must
    not find it; these tests import no megatron-core module inside the block)."""
    before = set(sys.modules)
    sys.path.insert(0, TE_STUB)
    try:
        importlib.import_module("transformer_engine.pytorch")
        yield importlib.import_module("transformer_engine")
    finally:
        sys.path.remove(TE_STUB)
        for name in set(sys.modules) - before:
            if name == "transformer_engine" or name.startswith("transformer_engine."):
                del sys.modules[name]


def _module_names(path: str) -> set[str]:
    """Top-level names a module of the wheel defines or imports (``from .x import *`` followed)."""
    tree = _te_source(path)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name == "*":
                    base = path.rsplit("/", 1)[0] + "/" + node.module.replace(".", "/")
                    names |= _module_names(base + "/__init__.py")
                else:
                    names.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return names


# the stand-in's modules -> the wheel's file that defines (or re-exports) the same names
STUB_MODULES = {
    "transformer_engine.pytorch": "transformer_engine/pytorch/__init__.py",
    "transformer_engine.pytorch.module": "transformer_engine/pytorch/module/__init__.py",
    "transformer_engine.pytorch.attention": "transformer_engine/pytorch/attention/__init__.py",
    "transformer_engine.pytorch.fp8": "transformer_engine/pytorch/fp8.py",
    "transformer_engine.pytorch.distributed": "transformer_engine/pytorch/distributed.py",
    "transformer_engine.pytorch.tensor": "transformer_engine/pytorch/tensor/__init__.py",
    "transformer_engine.pytorch.router": "transformer_engine/pytorch/router.py",
    "transformer_engine.pytorch.optimizers": "transformer_engine/pytorch/optimizers/__init__.py",
    "transformer_engine.pytorch.ops": "transformer_engine/pytorch/ops/__init__.py",
    "transformer_engine.common.recipe": "transformer_engine/common/recipe/__init__.py",
}


def test_every_public_name_of_the_stand_in_exists_in_te():
    with te_stub() as te:
        assert te.__version__ == TE_VERSION
        for mod, path in STUB_MODULES.items():
            stub = importlib.import_module(mod)
            public = {n for n, v in vars(stub).items() if not n.startswith("_") and not inspect.ismodule(v)
                      and (getattr(v, "__module__", mod).startswith("transformer_engine") or n == "FusedAdam")}
            public -= {"annotations", "dataclass", "contextmanager", "Callable", "Optional", "Enum", "torch", "F",
                       "dist", "GemmParallelModes", "column_input", "row_output", "init_method_constant",
                       "set_tensor_model_parallel_attributes", "TransformerEngineBaseModule"}
            missing = public - _module_names(path)
            assert not missing, (mod, sorted(missing))


def _sig(cls_or_fn) -> list[tuple[str, str | None]]:
    return [(p.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in inspect.signature(cls_or_fn).parameters.values() if p.name != "self"]


def _te_sig(path: str, cls: str, method: str) -> list[tuple[str, str | None]]:
    node = next(n for n in ast.walk(_te_source(path)) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = _method(node, method)
    args = fn.args.args[1:] + fn.args.kwonlyargs
    defaults = [None] * (len(fn.args.args[1:]) - len(fn.args.defaults)) + list(fn.args.defaults) + list(
        fn.args.kw_defaults)
    out = []
    for a, d in zip(args, defaults):
        out.append((a.arg, None if d is None else repr(ast.literal_eval(d)) if _literal(d) else "<expr>"))
    if fn.args.kwarg:
        out.append((fn.args.kwarg.arg, None))
    return out


def _literal(node) -> bool:
    try:
        ast.literal_eval(node)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("name, path, methods", [
    ("Linear", "transformer_engine/pytorch/module/linear.py", ("__init__", "forward")),
    ("LayerNormLinear", "transformer_engine/pytorch/module/layernorm_linear.py", ("__init__", "forward")),
    ("RMSNorm", "transformer_engine/pytorch/module/rmsnorm.py", ("__init__",)),
    ("LayerNorm", "transformer_engine/pytorch/module/layernorm.py", ("__init__",)),
    ("DotProductAttention", "transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py",
     ("__init__", "forward", "set_context_parallel_group")),
    ("GroupedLinear", "transformer_engine/pytorch/module/grouped_linear.py", ("__init__", "forward")),
])
def test_the_stand_in_layers_take_te_arguments_with_te_defaults(name, path, methods):
    """Every argument megatron-core's TE extension passes reaches a parameter of that name: the
    stand-in's signatures are TE's, names in order and literal defaults."""
    with te_stub() as te:
        cls = getattr(te.pytorch, name)
        for method in methods:
            ours, theirs = _sig(getattr(cls, method)), _te_sig(path, name, method)
            assert [n for n, _ in ours] == [n for n, _ in theirs], (method, ours, theirs)
            for (n, d), (_, t) in zip(ours, theirs):
                if t not in (None, "<expr>"):
                    assert d == t, (method, n, d, t)


def test_the_stand_in_registers_te_parameter_names_and_parallel_tags():
    lin_src = ast.unparse(_te_source("transformer_engine/pytorch/module/linear.py"))
    lnl_src = ast.unparse(_te_source("transformer_engine/pytorch/module/layernorm_linear.py"))
    norm_src = ast.unparse(_te_source("transformer_engine/pytorch/ops/basic/rmsnorm.py"))
    base_src = ast.unparse(_te_source("transformer_engine/pytorch/module/base.py"))
    assert "self.weight_names = ['weight']" in lin_src and "self.bias_names = ['bias']" in lin_src
    assert "'layer_norm_weight'," in lnl_src and "'layer_norm_bias'," in lnl_src
    assert "self.register_parameter('weight', weight)" in norm_src
    tag = "set_tensor_model_parallel_attributes(tensor=getattr(self, weight), is_parallel=True, dim=1 if " \
          "self.parallel_mode == 'row' else 0, stride=1)"
    assert tag in lin_src and tag in lnl_src
    assert "setattr(self.layer_norm_weight, 'sequence_parallel', self.sequence_parallel)" in lnl_src
    assert "return torch.empty(0, dtype=torch.uint8)" in base_src  # extra state without fp8
    with te_stub() as te:
        cpu = dict(device="cpu", params_dtype=torch.float32)
        col = te.pytorch.Linear(8, 6, parallel_mode="column", **cpu)
        row = te.pytorch.Linear(8, 6, parallel_mode="row", bias=True, sequence_parallel=True, **cpu)
        lnl = te.pytorch.LayerNormLinear(8, 6, normalization="RMSNorm", parallel_mode="column", bias=False,
                                         sequence_parallel=True, **cpu)
        norm = te.pytorch.RMSNorm(hidden_size=8, sequence_parallel=True, **cpu)
        assert [n for n, _ in col.named_parameters()] == ["weight", "bias"]
        assert [n for n, _ in lnl.named_parameters()] == ["layer_norm_weight", "weight"]
        assert lnl.bias.numel() == 0 and lnl.layer_norm_bias is None  # no bias: an empty tensor, as TE sets it
        assert [n for n, _ in norm.named_parameters()] == ["weight"]
        assert (col.weight.tensor_model_parallel, col.weight.partition_dim) == (True, 0)
        assert (row.weight.tensor_model_parallel, row.weight.partition_dim) == (True, 1)
        assert row.bias.sequence_parallel is False  # TP 1: TE switches sequence parallelism off
        assert lnl.layer_norm_weight.sequence_parallel is False and norm.weight.sequence_parallel is True
        for m in (col, lnl, norm):
            e = m.get_extra_state()
            assert e.dtype == torch.uint8 and e.numel() == 0
            m.set_extra_state(e)


def test_the_stand_in_grouped_linear_is_te_s_per_gemm_layout_and_product():
    """TE 2.20.2's GroupedLinear as the stand-in mirrors it: one ``weight{i}`` (``bias{i}``) per
    GEMM, registered under those names (read from TE's source), the parallel tags TE sets, a
    column / row mode that only shrinks the shapes; the product: the input's rows split by
    ``m_splits``, block i through GEMM i (an empty block included)."""
    src = ast.unparse(_te_source("transformer_engine/pytorch/module/grouped_linear.py"))
    assert "self.register_parameter(f'weight{i}'," in src and "self.register_parameter(f'bias{i}'," in src
    assert "tensor=getattr(self, f'weight{i}'), is_parallel=True, dim=1 if self.parallel_mode == 'row' else 0" in src
    g = torch.Generator().manual_seed(1)
    with te_stub() as te:
        cpu = dict(device="cpu", params_dtype=torch.float32)
        lin = te.pytorch.GroupedLinear(3, 8, 6, bias=True, **cpu)
        assert [n for n, _ in lin.named_parameters()] == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
        with torch.no_grad():
            for p in lin.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(7, 8, generator=g)
        splits = [3, 0, 4]
        want = torch.cat([torch.nn.functional.linear(b, getattr(lin, f"weight{i}"), getattr(lin, f"bias{i}"))
                          for i, b in enumerate(torch.split(x, splits))])
        torch.testing.assert_close(lin(x, splits), want)
        torch.testing.assert_close(lin(x, torch.tensor(splits)), want)
        col = te.pytorch.GroupedLinear(2, 8, 6, bias=False, parallel_mode="column", tp_size=2, **cpu)
        row = te.pytorch.GroupedLinear(2, 8, 6, bias=False, parallel_mode="row", tp_size=2, **cpu)
        assert col.weight0.shape == (3, 8) and row.weight1.shape == (6, 4)
        assert (col.weight0.partition_dim, row.weight1.partition_dim) == (0, 1)
        assert lin.get_extra_state().numel() == 0
        with pytest.raises(ValueError, match="does not match number of GEMMs"):
            lin(x, [7])


def test_the_stand_in_layers_compute_what_te_computes_at_tp1():
    """TE's arithmetic at TP=1 in torch: the norm in fp32 (``zero_centered_gamma``: 1 + w), the
    GEMM, a row-parallel bias after the product; attention over ``thd`` segments equal to the
    same sequences one by one in ``sbhd``, grouped-query heads equal to repeated heads, a padding
    mask equal to dropping the masked keys."""
    g = torch.Generator().manual_seed(0)
    with te_stub() as te:
        cpu = dict(device="cpu", params_dtype=torch.float32)
        lnl = te.pytorch.LayerNormLinear(8, 6, eps=1e-6, normalization="RMSNorm", bias=True, parallel_mode="column",
                                         zero_centered_gamma=True, **cpu)
        with torch.no_grad():
            for p in lnl.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(5, 2, 8, generator=g)
        want = torch.nn.functional.linear(
            torch.nn.functional.rms_norm(x, (8,), 1 + lnl.layer_norm_weight, 1e-6), lnl.weight, lnl.bias)
        torch.testing.assert_close(lnl(x), want, rtol=1e-6, atol=1e-6)
        lin = te.pytorch.Linear(8, 6, parallel_mode="row", bias=True, return_bias=True, **cpu)
        out, b = lin(x)
        assert b is lin.bias and torch.allclose(out, x @ lin.weight.T)

        dpa = te.pytorch.DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="causal")
        lens = [3, 5, 2]
        q, k, v = torch.randn(10, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g)
        cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
        packed = dpa(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type="padding_causal")
        assert packed.shape == (10, 32)
        mha = te.pytorch.DotProductAttention(4, 8, attn_mask_type="causal")
        for a, n in zip(cu[:-1].tolist(), lens):
            s = slice(a, a + n)
            one = dpa(q[s, None], k[s, None], v[s, None])  # sbhd, batch 1
            rep = mha(q[s, None], k[s, None].repeat_interleave(2, 2), v[s, None].repeat_interleave(2, 2))
            torch.testing.assert_close(packed[s], one[:, 0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(one, rep, rtol=1e-5, atol=1e-6)
        # padding: keys masked out (True = masked, TE's convention) are as if absent
        keep = 6
        mask = torch.zeros(1, 1, 1, 8, dtype=torch.bool)
        mask[..., keep:] = True
        full = dpa(q[:8, None], k[:8, None], v[:8, None], attention_mask=mask, attn_mask_type="padding_causal")
        cut = dpa(q[:keep, None], k[:keep, None], v[:keep, None])
        torch.testing.assert_close(full[:keep], cut, rtol=1e-5, atol=1e-6)


def test_what_the_layer_stand_in_does_not_cover_is_refused_by_name():
    with te_stub() as te:
        cpu = dict(device="cpu", params_dtype=torch.float32)
        with pytest.raises(NotImplementedError, match="fuse_wgrad_accumulation"):
            te.pytorch.Linear(8, 6, fuse_wgrad_accumulation=True, **cpu)
        with pytest.raises(NotImplementedError, match="userbuffers"):
            te.pytorch.LayerNormLinear(8, 6, ub_overlap_ag=True, **cpu)
        with pytest.raises(NotImplementedError, match="attention_dropout"):
            te.pytorch.DotProductAttention(4, 8, attention_dropout=0.1)
        with pytest.raises(NotImplementedError, match="fp8"):
            with te.pytorch.fp8_autocast(enabled=True):
                pass
        with pytest.raises(NotImplementedError, match="single_grouped_weight"):
            te.pytorch.GroupedLinear(2, 8, 8, single_grouped_weight=True, **cpu)
        with pytest.raises(NotImplementedError, match="fuse_wgrad_accumulation"):
            te.pytorch.GroupedLinear(2, 8, 8, fuse_wgrad_accumulation=True, **cpu)
        with pytest.raises(ValueError, match="doesn't support bias when TP > 1"):
            te.pytorch.GroupedLinear(2, 8, 8, tp_size=2, **cpu)
        with pytest.raises(NotImplementedError, match="op fuser"):
            te.pytorch.ops.Sequential()
        with pytest.raises(NotImplementedError, match="fp8 extra state"):
            te.pytorch.Linear(8, 6, **cpu).set_extra_state(torch.ones(3, dtype=torch.uint8))
    assert "transformer_engine" not in sys.modules  # nothing of it stays behind
