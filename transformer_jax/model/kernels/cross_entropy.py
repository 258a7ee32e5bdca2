"""Per-token label-smoothed cross entropy with its backward written out (`token_losses`).

The cross entropy over a 37,000-word vocabulary is the largest tensor of a step: written the
plain way (`log_softmax` in float32, then gather), autodiff keeps the float32
log-probabilities of the whole batch for the backward pass, twice the bytes of bfloat16
logits, and builds the gradient with a scatter. `token_losses` instead keeps only the logits
(in their own dtype) and a float32 log-normalizer a token, and computes the gradient in one
elementwise pass, `softmax - (1 - eps) onehot - eps / V`, that XLA fuses with its float32
softmax so that no float32 [batch, length, vocab] array is ever stored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_losses(
    logits: Array, targets: Array, label_smoothing: float
) -> tuple[Array, Array, Array]:
  """Per-token label-smoothed and plain cross entropy, computed in float32, and accuracy.

  Label smoothing follows Szegedy et al., as the paper cites it: the target distribution is
  (1 - eps) on the reference token plus eps spread uniformly over the whole vocabulary, so
  smoothed = (1 - eps) * nll + eps * (logsumexp - mean logit).

  Three reductions over the [..., vocab] logits: their max, the sum of exp(logit - max) and
  the sum of the logits. The log-normalizer, the smoothing term and the accuracy (the
  reference's logit is the max: no argmax pass) all come from these.

  Args:
    logits: [..., vocab] in any float dtype.
    targets: [...] reference ids.
    label_smoothing: eps.

  Returns:
    (smoothed, nll, correct), float32 [...] each; `correct` is 1 where the reference has the
    largest logit (a tie for the largest counts), 0 elsewhere, and has no gradient.
  """
  return _token_losses(logits, targets, label_smoothing)[0]


def _token_losses(logits, targets, eps, sum_x=None):
  x = logits.astype(jnp.float32)
  top = jnp.max(x, axis=-1)
  shift = jnp.where(jnp.isfinite(top), top, 0.0)  # As jax.nn.logsumexp: no inf - inf.
  # Two plain sums, not one variadic reduction: XLA:CPU vectorizes the plain ones only
  # (bench/RESULTS.md, section "CPU training: the main job's size and base").
  lse = shift + jnp.log(jnp.sum(jnp.exp(x - shift[..., None]), axis=-1))
  if sum_x is None:
    sum_x = jnp.sum(x, axis=-1)
  # Gather from the logits' own dtype: the same value, and no float32 copy to gather from.
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  target_logit = target_logit.astype(jnp.float32)
  nll = lse - target_logit
  smoothed = (1.0 - eps) * nll + eps * (lse - sum_x / x.shape[-1])
  correct = (target_logit >= top).astype(jnp.float32)
  return (smoothed, nll, correct), lse


def _token_losses_fwd(logits, targets, eps):
  out, lse = _token_losses(logits, targets, eps)
  return out, (logits, targets, lse)


def _token_losses_bwd(eps, residuals, cotangents, uniform=True):
  logits, targets, lse = residuals
  g_smoothed, g_nll, _ = cotangents  # float32 [...]; `correct` has no gradient.
  vocab = logits.shape[-1]
  softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
  onehot = jax.nn.one_hot(targets, vocab, dtype=jnp.float32)
  # d smoothed = softmax - (1 - eps) onehot - eps / V;  d nll = softmax - onehot.
  grad = (g_smoothed + g_nll)[..., None] * softmax - ((1.0 - eps) * g_smoothed + g_nll)[
      ..., None
  ] * onehot
  if uniform:  # The smoothing term's -eps / V, unless its sum was given (`given_sums`).
    grad = grad - (eps / vocab) * g_smoothed[..., None]
  return grad.astype(logits.dtype), None


token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def token_losses_given_sums(
    logits: Array, targets: Array, logit_sums: Array, label_smoothing: float
) -> tuple[Array, Array, Array]:
  """`token_losses` with each token's sum of logits over the vocabulary given.

  The logits are linear in the decoder's output y, so their sum over the vocabulary is y
  times the output projection's column sums (`Decoder`'s 'logit_sums'): no reduction over
  [..., vocab], two passes over the logits instead of three, and the sum's gradient goes to y
  and the projection through that product instead of into the logits' gradient. The same as
  `token_losses` to rounding (the given sum is of the logits before they are rounded to
  their dtype).

  Args:
    logits: [..., vocab] in any float dtype.
    targets: [...] reference ids.
    logit_sums: [...] float32, each token's sum of its logits.
    label_smoothing: eps.
  """
  return _token_losses(logits, targets, label_smoothing, logit_sums)[0]


def _given_sums_fwd(logits, targets, logit_sums, eps):
  out, lse = _token_losses(logits, targets, eps, logit_sums)
  return out, (logits, targets, lse)


def _given_sums_bwd(eps, residuals, cotangents):
  logits, targets, lse = residuals
  g_smoothed = cotangents[0]
  # The smoothing term eps * (lse - sum / V): its lse part is in the logits' gradient, and
  # its sum part, -eps / V, goes to the sums.
  grad_logits, _ = _token_losses_bwd(eps, residuals, cotangents, uniform=False)
  return grad_logits, None, -(eps / logits.shape[-1]) * g_smoothed


token_losses_given_sums.defvjp(_given_sums_fwd, _given_sums_bwd)
