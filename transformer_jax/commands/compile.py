r"""Compiles the real train step for a TPU slice or GPU host this machine does not have.

  .venv-aot/bin/python compile.py --config=configs/wmt14_ende_big.py --topology=v5e-8 \
      --config.mesh.fsdp=8 --config.mesh.data=1 --json=big_v5e8.json
  .venv-aot/bin/python compile.py --config=configs/wmt14_ende_base.py --topology=8xH100 \
      --search_batch
  .venv-aot/bin/python compile.py --config=configs/tiny.py --topology=2x8xH200 --decode

No accelerator, driver or data is needed: the compile-only wheels (libtpu, the CUDA PJRT
plugin and cuDNN) let XLA compile for the target. They live in an environment of their own:
`bash scripts/setup.sh --aot` makes .venv-aot in a checkout, `python -m
transformer_jax.aot.aot_env DIR` anywhere (then `DIR/bin/python -m
transformer_jax.commands.compile ...`). The step is exactly train.py's: the
config's mesh, shardings, dtype, remat and attention, and the input pipeline's largest batch
shape (the longest bucket, or packed rows), with the vocabulary size from the config
(`vocab_size` or `vocab_size_target`). Printed per device: the memory the step needs
against the device's (fits or not, and the headroom), XLA's FLOPs against the model count
of `flops.py`, the collectives and their bytes, the compile time, and the step's kernels
(`hlo_view`: counts, passes over the logits, bytes, and on GPU and TPU targets a roofline
estimate of the step's time, with the `--kernels` costliest listed); `--search_batch` adds
the largest `tokens_per_batch` that fits (a search of a few compiles within
--search_budget_s), and `--decode` compiles translate.py's beam search as well.

A TPU compile fails when the step does not fit (reported as "does not fit"); a GPU compile
never does, so the peak is compared with the device's memory here. On GPU, JAX by default
reserves 75% of the memory for itself (XLA_PYTHON_CLIENT_MEM_FRACTION).

Exit codes: 0 done (fitting or not); 1 an unexpected error; 2 a flag, config or topology
problem, or the compile-only wheels missing (explained in one paragraph).
"""

import dataclasses
import json
import os
import sys

# This command compiles for the --topology, never for this machine's own accelerator, and
# libtpu must not claim a TPU on a machine that has none.
os.environ['JAX_PLATFORMS'] = 'cpu'

from absl import flags
from ml_collections import config_flags

from transformer_jax.commands import cli
from transformer_jax.storage import paths
from transformer_jax.storage import storage

_CONFIG = config_flags.DEFINE_config_file(
    'config',
    None,
    'A config file (configs/*.py); override fields with --config.FIELD=VALUE.',
    lock_config=True,
)
_TOPOLOGY = flags.DEFINE_string(
    'topology',
    None,
    'What to compile for: a TPU slice (v4-8, v5e-8, v5e-256, v5p-8, v6e-8, '
    'or a libtpu name such as v5e:4x4), a GPU host layout (8xH100, 1xH200, 2x8xH100 = 2 hosts '
    'of 8), or cpu.',
)
_JSON = flags.DEFINE_string('json', None, 'Also write the whole report as JSON here.')
_SEARCH = flags.DEFINE_bool(
    'search_batch', False, 'Search the largest tokens_per_batch that fits one device.'
)
_SEARCH_BUDGET = flags.DEFINE_float(
    'search_budget_s', 600.0, 'Stop the batch search after this many seconds.'
)
_MEMORY = flags.DEFINE_float(
    'memory_limit_gib',
    None,
    'Compare with this much memory a device instead of the '
    "device's own (e.g. what XLA_PYTHON_CLIENT_MEM_FRACTION leaves).",
)
_DECODE = flags.DEFINE_bool('decode', False, "Also compile translate.py's search.")
_KERNELS = flags.DEFINE_integer(
    'kernels',
    10,
    "List this many of the step's kernels, the costliest by the roofline "
    'estimate (GPU and TPU targets).',
    lower_bound=0,
)


def _gib(n) -> str:
  """Bytes in the largest binary unit that leaves at least 1."""
  if n is None:
    return 'n/a'
  for unit, shift in (('GiB', 30), ('MiB', 20), ('KiB', 10)):
    if abs(n) >= 1 << shift:
      return f'{n / (1 << shift):.2f} {unit}'
  return f'{n} B'


def _print_step(name: str, r: dict) -> None:
  if 'peak_bytes' not in r:
    print(f'{name}: does not fit: {r.get("error", "")}')
    return
  verdict = 'fits' if r['fits'] else 'DOES NOT FIT'
  print(
      f'{name}: {_gib(r["peak_bytes"])} of {_gib(r["device_memory_bytes"])} per device: '
      f'{verdict} (headroom {_gib(r["headroom_bytes"])}); compiled in {r["compile_s"]} s'
  )
  m = r['memory']
  print(
      f'  memory: arguments {_gib(m["argument"])}, outputs {_gib(m["output"])}, donated '
      f'{_gib(m["alias"])}, temporaries {_gib(m["temp"])}'
  )
  if r.get('xla_flops') and r.get('model_flops'):
    print(
        f'  FLOPs per device: XLA {r["xla_flops"]:.4g}, model {r["model_flops"]:.4g} '
        f'(x{r["xla_over_model_flops"]:.2f})'
    )
  if r['collectives']:
    print(
        '  collectives: '
        + ', '.join(
            f'{k} {v["count"]}x {_gib(v["bytes"])}' for k, v in sorted(r['collectives'].items())
        )
    )
  else:
    print('  collectives: none')
  if r['fused_attention_calls']:
    masks = ', '.join(f'{k} {v}' for k, v in sorted(r['fused_attention_masks'].items()))
    print(f'  cuDNN fused attention calls: {r["fused_attention_calls"]} ({masks})')


def _print_kernels(v: dict) -> None:
  """The step's kernels (`aot.step_view`)."""
  triton = f'{v["triton_kernels"]} Pallas (Triton), ' if v['triton_kernels'] else ''
  print(
      f'  kernels a step: {v["kernels"]:,} ({v["matmul_kernels"]} matmul, '
      f'{v["fused_attention_kernels"]} cuDNN attention, {triton}{v["collective_kernels"]} '
      f'collective); passes over a [tokens, vocab] array: {v["logits_passes"]}; '
      f'{_gib(v["bytes_accessed"])} accessed'
  )
  if not v['estimate_s']:
    return
  kinds = ', '.join(f'{k} {s * 1e3:.3g}' for k, s in v['estimate_s_by_kind'].items() if s)
  print(
      f'  roofline estimate (not a measurement; each kernel at the longer of its FLOPs at '
      f'{v["peak_flops"] / 1e12:.0f} TFLOP/s and its bytes at '
      f'{v["bandwidth_bytes_per_s"] / 1e12:.2f} TB/s): {v["estimate_s"] * 1e3:.3g} ms a '
      f'step, MFU {v["estimated_mfu"]:.1%}; ms by kind: {kinds}'
  )
  for k in v.get('top_kernels', []):
    where = k['op_name'].split('/')
    print(
        f'    {k["estimate_s"] * 1e3:9.3g} ms  {k["category"]:<15} {k["kind"]:<13} '
        f'{k["flops"] / 1e9:8.3g} GFLOP {_gib(k["bytes"]):>11}'
        f'{"  x" + str(k["count"]) if k["count"] > 1 else ""}  {"/".join(where[-3:])}'
    )


def main(argv: list[str]) -> None:
  del argv  # Unused.
  if _CONFIG.value is None:
    cli.fail('--config is required, e.g. --config=configs/wmt14_ende_base.py.')
  if not _TOPOLOGY.value:
    cli.fail('--topology is required, e.g. --topology=v5e-8 or --topology=8xH100.')
  from transformer_jax.aot import aot

  if _JSON.value:
    config_file = next((a.split('=', 1)[1] for a in sys.argv if a.startswith('--config=')), None)
    paths.check_output_file(_JSON.value, '--json', {'--config': config_file})
  config = _CONFIG.value
  target = aot.target(_TOPOLOGY.value)
  if _MEMORY.value is not None:
    if _MEMORY.value <= 0:
      cli.fail(f'--memory_limit_gib={_MEMORY.value} must be positive.')
    target = dataclasses.replace(target, memory_bytes=int(_MEMORY.value * (1 << 30)))
  result = aot.compile_train_step(config, target, top_kernels=_KERNELS.value)
  mesh = ', '.join(f'{k}={v}' for k, v in result['mesh'].items())
  print(
      f'{target.name}: {result["devices"]} x {result["device_kind"]} on {result["hosts"]} '
      f'host(s); mesh {mesh}; {result["params"]:,} parameters, {result["dtype"]}, remat '
      f'{result["remat_policy"]}, attention {result["attention_implementation"]}'
  )
  b = result['batch']
  print(
      f'batch: {b["rows"]} rows x {b["length"]} tokens a side ({b["tokens_per_side"]:,} token '
      'slots, the longest bucket or packed rows)'
  )
  _print_step('train step', result)
  if 'kernels' in result:
    _print_kernels(result['kernels'])
  report = {'train_step': result}
  if _SEARCH.value:
    search = aot.largest_train_batch(
        config,
        target,
        time_budget_s=_SEARCH_BUDGET.value,
        log=lambda line: print(f'  search: {line}', flush=True),
    )
    print(
        f'largest batch that fits: {search["largest_rows"]} rows x {search["length"]} = '
        f'tokens_per_batch {search["largest_tokens_per_batch"]:,} (smallest not fitting: '
        f'{search["smallest_not_fitting_rows"]} rows; {search["search_s"]} s)'
    )
    report['largest_batch'] = search
  if _DECODE.value:
    decoder = aot.compile_decoder(config, target)
    _print_step(
        f'decoder ({decoder["rows"]} rows x {decoder["source_length"]} source tokens, '
        f'beam {decoder["beam_size"]}, up to {decoder["max_decode_len"]} output '
        'tokens)',
        decoder,
    )
    report['decoder'] = decoder
  if _JSON.value:
    report['config'] = config.to_dict()
    storage.write_file(_JSON.value, json.dumps(report, indent=1, default=str))
    print(f'wrote {_JSON.value}')


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()
