"""The reference side: Hugging Face `MarianMTModel` (PyTorch) and CTranslate2.

Decoding runs this project's own benchmark model in both: the JAX side exports its random
weights with `marian.write_model` (the export users serve with), `MarianMTModel` loads that
directory and CTranslate2 converts it with its own converter, so the three systems decode
the same sources with the same weights, and each reports its outputs (the same tokens as
ours wherever no near-tie splits them). The model starts its decoder from a zero vector
(`decoder_start='zero'`), as CTranslate2 starts every Marian model.

The training step runs a `MarianMTModel` of the same dimensions built from a `MarianConfig`
with random weights (nothing is downloaded): the paper's Transformer as Marian trains it,
post-norm, ReLU, sinusoidal positions, embeddings scaled by sqrt(d_model) and one matrix
shared by the source and target embeddings and the output projection. Against the main job's
pre-norm config it runs `M2M100ForConditionalGeneration`, the same but pre-norm.

Run by `bench.run` as a worker process (see `bench/worker.py`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import numpy as np

from bench import breakdown as bench_breakdown
from bench import sizes
from bench import worker

EOS_ID = 2  # As in this project; Marian's pad is vocab_size - 1.
FIRST_ORDINARY_ID = 4
SOURCES_FILE = 'bench_sources.npy'  # Beside the exported model: the decoding bench's inputs.

THREADS = int(os.environ.get('BENCH_THREADS', '2'))


def _torch():
  import torch  # Imported late: a GPU machine may run the JAX side without torch.

  torch.set_num_threads(THREADS)
  return torch


def marian_config(model: str, vocab_size: int, max_length: int = 512, dropout: float = 0.1):
  """A `MarianConfig` with this project's dimensions (the paper's base or big model)."""
  import transformers

  size = sizes.dimensions(model)
  pad = vocab_size - 1
  return transformers.MarianConfig(
      vocab_size=vocab_size,
      d_model=size['d_model'],
      encoder_layers=size['num_encoder_layers'],
      decoder_layers=size['num_decoder_layers'],
      encoder_attention_heads=size['num_heads'],
      decoder_attention_heads=size['num_heads'],
      encoder_ffn_dim=size['d_ff'],
      decoder_ffn_dim=size['d_ff'],
      activation_function='relu',
      dropout=dropout,
      attention_dropout=0.0,
      activation_dropout=0.0,
      scale_embedding=True,
      share_encoder_decoder_embeddings=True,
      tie_word_embeddings=True,
      max_position_embeddings=max_length,
      pad_token_id=pad,
      eos_token_id=EOS_ID,
      decoder_start_token_id=pad,
      forced_eos_token_id=None,
      bos_token_id=None,
  )


def marian_model(model: str, vocab_size: int, attn_implementation: str | None = None):
  """A randomly initialised `MarianMTModel` (seeded)."""
  torch = _torch()
  import transformers

  torch.manual_seed(0)
  kwargs = {} if attn_implementation is None else {'attn_implementation': attn_implementation}
  return transformers.MarianMTModel(marian_config(model, vocab_size), **kwargs)


def random_ids(rows: int, length: int, vocab_size: int, seed: int = 0) -> np.ndarray:
  """Ordinary ids (neither this project's specials nor Marian's pad), EOS last."""
  ids = np.random.default_rng(seed).integers(
      FIRST_ORDINARY_ID, vocab_size - 1, (rows, length), dtype=np.int64
  )
  ids[:, -1] = EOS_ID
  return ids


def pre_norm_model(size: dict[str, Any], vocab_size: int, max_length: int = 512):
  """A randomly initialised (seeded) pre-norm Transformer of Hugging Face's: the
  `M2M100ForConditionalGeneration` architecture, which normalizes before each sub-layer and
  after each stack as this project's `norm_position='pre'` does, with sinusoidal positions,
  embeddings scaled by sqrt(d_model) and one matrix for the embeddings and the output.

  Args:
    size: d_model, heads, d_ff, encoder_layers, decoder_layers, dropout.
  """
  torch = _torch()
  import transformers

  torch.manual_seed(0)
  # M2M100 numbers positions from its pad id on, so that id must be small (its own is 1);
  # the random batches never use it.
  pad = 1
  config = transformers.M2M100Config(
      vocab_size=vocab_size,
      d_model=size['d_model'],
      encoder_layers=size['encoder_layers'],
      decoder_layers=size['decoder_layers'],
      encoder_attention_heads=size['heads'],
      decoder_attention_heads=size['heads'],
      encoder_ffn_dim=size['d_ff'],
      decoder_ffn_dim=size['d_ff'],
      activation_function='relu',
      dropout=size['dropout'],
      attention_dropout=0.0,
      activation_dropout=0.0,
      encoder_layerdrop=0.0,
      decoder_layerdrop=0.0,
      scale_embedding=True,
      tie_word_embeddings=True,
      max_position_embeddings=max_length,
      pad_token_id=pad,
      eos_token_id=EOS_ID,
      bos_token_id=0,
      decoder_start_token_id=EOS_ID,
      forced_eos_token_id=None,
  )
  return transformers.M2M100ForConditionalGeneration(config)


class TorchTrainTask:
  """A full training step of `MarianMTModel` (post-norm) or, given a `size` with
  `norm='pre'`, of the pre-norm `pre_norm_model`: forward, label-smoothed loss, backward,
  Adam."""

  def __init__(
      self,
      model: str = 'base',
      rows: int = 8,
      source_length: int = 64,
      target_length: int = 64,
      vocab_size: int = 37000,
      attn_implementation: str | None = None,
      fused_adam: bool = False,
      size: dict[str, Any] | None = None,
  ):
    self.args = (model, rows, source_length, target_length, vocab_size)
    self.attn_implementation, self.fused_adam = attn_implementation, fused_adam
    self.size = size

  def setup(self) -> dict[str, Any]:
    torch = _torch()
    model, rows, source_length, target_length, vocab_size = self.args
    start = time.perf_counter()
    if self.size and self.size.get('norm') == 'pre':
      self.model = pre_norm_model(self.size, vocab_size).train()
    else:
      self.model = marian_model(model, vocab_size, self.attn_implementation).train()
    init_s = time.perf_counter() - start
    self.optimizer = torch.optim.Adam(
        self.model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=self.fused_adam or None
    )
    self.inputs = torch.from_numpy(random_ids(rows, source_length, vocab_size))
    targets = random_ids(rows, target_length, vocab_size, seed=1)
    self.labels = torch.from_numpy(targets)
    decoder_inputs = np.concatenate([np.full((rows, 1), vocab_size - 1), targets[:, :-1]], axis=1)
    self.decoder_inputs = torch.from_numpy(decoder_inputs)
    self.mask = torch.ones_like(self.inputs)
    start = time.perf_counter()
    self.run()
    first_step_s = time.perf_counter() - start
    return {
        'init_s': init_s,
        'first_step_s': first_step_s,
        'params': sum(p.numel() for p in self.model.parameters()),
        'attn_implementation': self.model.config._attn_implementation,
        'torch': torch.__version__,
        'threads': torch.get_num_threads(),
        'loss_per_token': self.loss,
    }

  def run(self) -> None:
    torch = _torch()
    logits = self.model(
        input_ids=self.inputs, attention_mask=self.mask, decoder_input_ids=self.decoder_inputs
    ).logits
    # Sum over tokens, divided once by their count, as train_steps does.
    loss = (
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            self.labels.reshape(-1),
            label_smoothing=0.1,
            reduction='sum',
        )
        / self.labels.numel()
    )
    loss.backward()
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)
    self.loss = float(loss.detach())

  def dispatch(self) -> None:
    """A step back to back with the last: PyTorch's CPU step has ended when `run` returns."""
    self.run()

  def wait(self) -> None:
    """Nothing is left running after `dispatch`."""

  def breakdown(self, steps: int) -> dict[str, Any]:
    """Where `steps` more steps spend their time, by kind (`bench/breakdown.py`)."""
    from torch import profiler

    with profiler.profile(activities=[profiler.ProfilerActivity.CPU]) as prof:
      start = time.perf_counter()
      for _ in range(steps):
        self.run()
      wall_s = time.perf_counter() - start
    return bench_breakdown.torch_breakdown(prof.events(), steps, wall_s)


def exported_sources(model_dir: str) -> np.ndarray:
  """The bench's sources, in the exported model's ids (written by the JAX side)."""
  return np.load(os.path.join(model_dir, SOURCES_FILE))


class GenerateTask:
  """`MarianMTModel.generate` on the exported model: greedy or beam search with exactly
  `output_length` tokens."""

  def __init__(
      self, model_dir: str, output_length: int = 32, beam_size: int = 1, alpha: float = 0.6
  ):
    self.model_dir = model_dir
    self.output_length, self.beam_size, self.alpha = output_length, beam_size, alpha

  def setup(self) -> dict[str, Any]:
    torch = _torch()
    import transformers

    self.model = transformers.MarianMTModel.from_pretrained(self.model_dir).eval()
    self.inputs = torch.from_numpy(exported_sources(self.model_dir))
    start = time.perf_counter()
    self.run()
    first_s = time.perf_counter() - start
    outputs = self.output[:, 1:].numpy()  # The decoder start token comes first.
    if outputs.shape[1] != self.output_length:
      raise AssertionError(
          f'generate produced {outputs.shape[1]} tokens, not {self.output_length}.'
      )
    return {
        'first_s': first_s,
        'generated_tokens': outputs.size,
        'attn_implementation': self.model.config._attn_implementation,
        'outputs': outputs.tolist(),
    }

  def run(self) -> None:
    torch = _torch()
    with torch.inference_mode():
      self.output = self.model.generate(
          input_ids=self.inputs,
          attention_mask=torch.ones_like(self.inputs),
          num_beams=self.beam_size,
          do_sample=False,
          max_new_tokens=self.output_length,
          min_new_tokens=self.output_length,
          num_return_sequences=1,
          **(dict(length_penalty=self.alpha, early_stopping=False) if self.beam_size > 1 else {}),
      )


class _Vocabulary:
  """What the CTranslate2 converter reads from a tokenizer: the exported vocab.json (the
  bench's export has no SentencePiece models for `MarianTokenizer` to load)."""

  def __init__(self, model_dir: str):
    with open(os.path.join(model_dir, 'vocab.json'), encoding='utf-8') as f:
      vocab = json.load(f)
    self.tokens = sorted(vocab, key=vocab.get)
    self.eos_token, self.unk_token, self.pad_token, self.bos_token = (
        '</s>',
        '<unk>',
        '<pad>',
        None,
    )

  def get_vocab(self) -> dict[str, int]:
    return {token: i for i, token in enumerate(self.tokens)}


def convert_to_ctranslate2(model_dir: str, output_dir: str) -> str:
  """Converts a Marian directory with `ctranslate2.converters.TransformersConverter`."""
  import ctranslate2

  class Converter(ctranslate2.converters.TransformersConverter):

    def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
      return _Vocabulary(model_dir)

  return Converter(model_dir).convert(output_dir, force=True)


class CTranslate2Task:
  """`ctranslate2.Translator.translate_batch` on the exported model, converted by
  CTranslate2's own converter, with exactly `output_length` tokens."""

  def __init__(
      self,
      model_dir: str,
      output_length: int = 32,
      beam_size: int = 1,
      alpha: float = 0.6,
      compute_type: str = 'float32',
  ):
    self.model_dir = model_dir
    self.output_length, self.beam_size, self.alpha = output_length, beam_size, alpha
    self.compute_type = compute_type

  def setup(self) -> dict[str, Any]:
    import ctranslate2

    self.tmp = tempfile.TemporaryDirectory(prefix='bench_ct2_')
    start = time.perf_counter()
    ct2_dir = convert_to_ctranslate2(self.model_dir, os.path.join(self.tmp.name, 'ct2'))
    convert_s = time.perf_counter() - start
    self.translator = ctranslate2.Translator(
        ct2_dir,
        device='cpu',
        compute_type=self.compute_type,
        inter_threads=1,
        intra_threads=THREADS,
    )
    vocab = _Vocabulary(self.model_dir)
    self.sources = [[vocab.tokens[i] for i in row] for row in exported_sources(self.model_dir)]
    start = time.perf_counter()
    self.run()
    first_s = time.perf_counter() - start
    lengths = [len(r.hypotheses[0]) for r in self.results]
    if set(lengths) != {self.output_length}:
      raise AssertionError(
          f'CTranslate2 produced lengths {sorted(set(lengths))}, not {self.output_length}.'
      )
    ids = vocab.get_vocab()
    return {
        'convert_s': convert_s,
        'first_s': first_s,
        'generated_tokens': sum(lengths),
        'ctranslate2': ctranslate2.__version__,
        'compute_type': self.compute_type,
        'outputs': [[ids[t] for t in r.hypotheses[0]] for r in self.results],
    }

  def run(self) -> None:
    self.results = self.translator.translate_batch(
        self.sources,
        beam_size=self.beam_size,
        max_decoding_length=self.output_length,
        min_decoding_length=self.output_length,
        length_penalty=self.alpha,
        max_batch_size=0,
        return_scores=False,
    )


class TorchMatmulTask:
  """Square float32 matrix multiplies through PyTorch (oneMKL/oneDNN on this build)."""

  def __init__(self, n: int = 2048):
    self.n = n

  def setup(self) -> dict[str, Any]:
    torch = _torch()
    generator = torch.Generator().manual_seed(0)
    self.a = torch.randn(self.n, self.n, generator=generator)
    self.b = torch.randn(self.n, self.n, generator=generator) / self.n**0.5
    self.run()
    return {'flops_per_iter': 2.0 * self.n**3, 'threads': torch.get_num_threads()}

  def run(self) -> None:
    self.c = self.a @ self.b


FACTORIES = {
    'torch_train': TorchTrainTask,
    'hf_generate': GenerateTask,
    'ct2_translate': CTranslate2Task,
    'torch_matmul': TorchMatmulTask,
}

if __name__ == '__main__':
  worker.serve(FACTORIES)
