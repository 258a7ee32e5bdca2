"""`transformer_jax.aot.hlo_view`: a compiled program's kernels read from its optimized HLO."""

import jax
import jax.numpy as jnp
import pytest

from transformer_jax.aot import hlo_view

# A hand-written module in the text form XLA prints: a dot fused with a convert, a loop of 3
# trips around a cuBLAS call, cuDNN attention forward and backward, a collective pair, a
# conditional whose costlier branch counts, and names, views and tuples that launch nothing.
MODULE = """HloModule jit_step, entry_computation_layout={(bf16[64,32]{1,0})->f32[]}

%fused_dot (param_0: bf16[64,32], param_1: bf16[32,1000]) -> f32[64,1000] {
  %param_0 = bf16[64,32]{1,0} parameter(0)
  %param_1 = bf16[32,1000]{1,0} parameter(1)
  %dot.1 = bf16[64,1000]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %convert.1 = f32[64,1000]{1,0} convert(%dot.1)
}

%body (p: (s32[], f32[16,16])) -> (s32[], f32[16,16]) {
  %p = (s32[], f32[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[16,16]{1,0} get-tuple-element(%p), index=1
  %gemm = (f32[16,16]{1,0}, s8[4]{0}) custom-call(%x, %x), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %y = f32[16,16]{1,0} get-tuple-element(%gemm), index=0
  ROOT %t = (s32[], f32[16,16]{1,0}) tuple(%i, %y)
}

%cond (p: (s32[], f32[16,16])) -> pred[] {
  %p = (s32[], f32[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%fused_gather (param_0: f32[64,1000], param_1: s32[64,1]) -> f32[64] {
  %param_0 = f32[64,1000]{1,0} parameter(0)
  %param_1 = s32[64,1]{1,0} parameter(1)
  %gather.1 = f32[64,1]{1,0} gather(%param_0, %param_1), offset_dims={}, collapsed_slice_dims={1}, start_index_map={1}, index_vector_dim=1, slice_sizes={1,1}
  ROOT %bitcast.2 = f32[64]{0} bitcast(%gather.1)
}

%cheap (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %neg = f32[4]{0} negate(%a)
}

%costly (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%a)
  ROOT %l = f32[4]{0} log(%e)
}

ENTRY %main (x: bf16[64,32], w: bf16[32,1000], q: bf16[2,8,4,16], s: (s32[], f32[16,16]), k: s32[], v: f32[4]) -> f32[] {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,1000]{1,0} parameter(1)
  %logits = f32[64,1000]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(step)/jvp(Transformer)/decoder/bld,vd->blv/dot_general"}
  %bits = f32[64,1000]{1,0} bitcast(%logits)
  %sum = f32[64]{0} reduce(%bits, %zero), dimensions={1}, to_apply=%add, metadata={op_name="jit(step)/jvp()/reduce_sum"}
  %labels = s32[64,1]{1,0} parameter(6)
  %picked = f32[64]{0} fusion(%logits, %labels), kind=kLoop, calls=%fused_gather
  %s = (s32[], f32[16,16]{1,0}) parameter(3)
  %loop = (s32[], f32[16,16]{1,0}) while(%s), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %q = bf16[2,8,4,16]{3,2,1,0} parameter(2)
  %fwd = (bf16[2,8,4,16]{3,2,1,0}, f32[2,4,8]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"mask_type": "PADDING_CAUSAL"}}, metadata={op_name="jit(step)/jvp(Transformer)/self_attention/dot_product_attention_fwd"}
  %bwd = (bf16[2,8,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config": {"mask_type": "PADDING"}}
  %ar = f32[64]{0} all-reduce-start(%sum), to_apply=%add
  %ard = f32[64]{0} all-reduce-done(%ar)
  %k = s32[] parameter(4)
  %v = f32[4]{0} parameter(5)
  %c = f32[4]{0} conditional(%k, %v, %v), branch_computations={%cheap, %costly}
  ROOT %out = f32[] reduce(%ard, %zero), dimensions={0}, to_apply=%add
}
"""  # noqa: E501  (HLO's lines are as long as XLA prints them)


def test_kernels_of_a_hand_written_module():
  kernels = {k.name: k for k in hlo_view.kernels(MODULE, 64 * 1000, 1000)}
  # Names, views, tuples, the -done halves and scalar arithmetic (the loop's condition)
  # launch nothing; the loop's body and the costlier branch (two operations to one) do.
  assert list(kernels) == ['logits', 'sum', 'picked', 'gemm', 'fwd', 'bwd', 'ar', 'e', 'l', 'out']
  logits = kernels['logits']
  assert (logits.category, logits.kind) == ('matmul', 'matmul')
  assert logits.flops == 2 * 64 * 1000 * 32
  assert logits.bytes == 64 * 32 * 2 + 32 * 1000 * 2 + 64 * 1000 * 4
  assert logits.touches_logits and kernels['sum'].touches_logits
  assert not kernels['gemm'].touches_logits
  # A fusion that only gathers from the logits reads what it gathers: no pass over them.
  assert kernels['picked'].bytes == 64 * 4 + 64 * 4 + 64 * 4
  assert not kernels['picked'].touches_logits
  assert (kernels['sum'].category, kernels['sum'].kind) == ('reduce', 'loss')
  gemm = kernels['gemm']
  assert (gemm.category, gemm.count, gemm.flops) == ('matmul', 3, 2 * 16 * 16 * 16)
  assert gemm.bytes == 16 * 16 * 4 * 3 + 4  # Two operands, the product and the workspace.
  # [batch 2, length 8, heads 4, head dim 16]: forward 2 products, causal; backward 5.
  products = 2 * 2 * 4 * 8 * 8 * 16
  assert kernels['fwd'].flops == 2 * products / 2 and kernels['bwd'].flops == 5 * products
  assert (kernels['fwd'].category, kernels['fwd'].kind) == ('fused attention', 'attention')
  assert kernels['ar'].category == 'collective'


def test_roofline_takes_the_longer_of_compute_and_memory_for_each_kernel():
  kernels = hlo_view.kernels(MODULE, 64 * 1000, 1000)
  view = hlo_view.roofline(kernels, peak_flops=1e12, bandwidth=1e9)
  assert view['kernels'] == 12 and view['matmul_kernels'] == 4
  assert view['fused_attention_kernels'] == 2 and view['collective_kernels'] == 1
  assert view['logits_passes'] == 2
  on_device = [k for k in kernels if k.category != 'collective']
  assert view['bytes_accessed'] == sum(k.bytes * k.count for k in on_device)
  expected = sum(max(k.flops / 1e12, k.bytes / 1e9) * k.count for k in on_device)
  assert view['estimate_s'] == pytest.approx(expected)
  assert sum(view['estimate_s_by_kind'].values()) == pytest.approx(expected)
  # At 1 GB/s everything here is bound by its bytes; at 1 TB/s and 1 GFLOP/s, the matmuls
  # and attention by their FLOPs.
  assert view['kernels_bound_by'] == {'compute': 0, 'memory': 11}
  fast_memory = hlo_view.roofline(kernels, peak_flops=1e9, bandwidth=1e12)
  assert fast_memory['kernels_bound_by']['compute'] == 6  # 3 gemm trips, logits, fwd, bwd.
  assert hlo_view.roofline(kernels, None, None)['estimate_s'] is None


def test_a_cpu_compiled_matmul_is_found_with_its_flops():
  """On XLA's own output, not only on hand-written text: a jitted [96,64] @ [64,200]."""
  compiled = (
      jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(jnp.ones((96, 64)), jnp.ones((64, 200))).compile()
  )
  kernels = hlo_view.kernels(compiled.as_text(), 96 * 200, 200)
  matmuls = [k for k in kernels if k.category == 'matmul']
  assert sum(k.flops * k.count for k in matmuls) == 2 * 96 * 64 * 200, kernels
  assert any(k.touches_logits for k in kernels)


def test_tuple_shapes_and_their_bytes():
  shape = '(f32[4,8]{1,0}, (bf16[16]{0}, s32[]), /*index=2*/u8[0]{0})'
  assert hlo_view.top_level(shape) == [
      'f32[4,8]{1,0}',
      ' (bf16[16]{0}, s32[])',
      ' /*index=2*/u8[0]{0}',
  ]
  assert hlo_view.shape_bytes(shape) == 4 * 32 + 2 * 16 + 4


@pytest.mark.parametrize(
    'opcode,op_name,expected',
    [
        ('fusion', 'jit(f)/Transformer.encode/encoder/layer_0/ffn/wi/dot_general', 'encoder'),
        (
            'dot',
            'jit(f)/while/body/Transformer.decode/decoder/layer_0/ffn/wi/dot_general',
            'matmul',
        ),
        (
            'dot',
            'jit(f)/while/body/Transformer.decode/decoder/output_layer/x/dot_general',
            'output layer',
        ),
        (
            'dynamic-update-slice',
            'jit(f)/while/body/Transformer.decode/decoder/layer_0/self_attention/c/dynamic_update_slice',
            'cache write',
        ),
        (
            'fusion',
            'jit(f)/while/body/Transformer.decode/decoder/layer_0/self_attention/exp',
            'attention',
        ),
        (
            'fusion',
            'jit(f)/while/body/Transformer.decode/decoder/layer_0/ffn_block/norm/rsqrt',
            'normalization',
        ),
        (
            'copy',
            'jit(f)/while/body/Transformer.decode/decoder/layer_0/ffn_block/transpose',
            'data movement',
        ),
        ('fusion', 'jit(f)/while/body/jit(take_along_axis)/gather', 'beam gathers'),
        ('custom-call', 'jit(f)/while/body/top_k', 'search'),
        ('compare', 'jit(f)/while/cond/lt', 'search'),
        ('fusion', 'jit(f)/while/body/Transformer.decode/decoder/positions/sin', 'other'),
        ('constant', '', 'other'),
    ],
)
def test_a_searchs_instructions_get_the_decode_kinds(opcode, op_name, expected):
  assert hlo_view.decode_kind('x', opcode, op_name) == expected
  assert expected in hlo_view.DECODE_KINDS
