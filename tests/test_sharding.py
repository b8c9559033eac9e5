"""Sharded runs on 8 fake CPU devices give the results of one device, and arrays are
sharded as declared in `epgrpo_jax.parallel.sharding`."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from epgrpo_jax.parallel import sharding
from epgrpo_jax.training.config import TrainConfig
from epgrpo_jax.models import from_pretrained, param_rules, preset, save_pretrained
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh
from epgrpo_jax.tasks import arithmetic
from epgrpo_jax.training.trainer import Trainer
from helpers import randomize

# (data, fsdp, tensor); (2, 2, 2) uses every axis and runs by default, the others in CI (slow).
MESHES = [pytest.param((2, 2, 2), id="2x2x2"),
          pytest.param((8, 1, 1), id="8x1x1", marks=pytest.mark.slow),
          pytest.param((2, 4, 1), id="2x4x1", marks=pytest.mark.slow)]
STEPS = 3
# Metrics that are clocks, not results.
TIMING = ("time", "tokens_per_second", "perf/")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  """The arithmetic task with a one-layer model whose random weights give varied greedy tokens
  and entropies (a near-uniform model would have all entropies alike, and the entropy gate,
  which divides by their spread, would magnify float noise past the tolerance)."""
  task = arithmetic.build_assets(tmp_path_factory.mktemp("arith"), seed=0, train_per_level=60,
                                 heldout_per_level=4, verbose=False,
                                 model_overrides={"num_layers": 1})
  model_dir = tmp_path_factory.mktemp("model")
  save_pretrained(randomize(from_pretrained(task.model_dir), seed=1, std=0.3), model_dir,
                  tokenizer_dir=task.model_dir)
  return dataclasses.replace(task, model_dir=model_dir)


def digit_reward(completions: list[str], answers: list[str]) -> list[float]:
  """A dense reward (the share of digits in the text): the random model earns varied rewards.

  With the task's exact-answer reward it earns 0 everywhere, so every advantage is float noise
  that Adam's first step blows up to +-learning_rate, differently under each summation order.
  """
  return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def config(task, out_dir, *overrides: str) -> TrainConfig:
  """Full EP-GRPO on 8 prompts x 4 samples. `advantage.eps=1e-3` (paper: 1e-6) keeps the
  progress term well-conditioned: it z-scores lambda * (log pi - log pi_ref) per entropy
  bucket, and at step 1 (LoRA B = 0) that difference is float noise (adapters on vs off),
  which a 1e-6 stabiliser would blow up to ~1e-2 differently under each summation order."""
  return TrainConfig().override(
      f"model.path={task.model_dir}", f"data.train_files=[{task.train_file}]",
      "data.prompt_template='{problem}'", "train.prompts_per_step=8", "train.num_generations=4",
      "sampling.max_new_tokens=16", "sampling.length_buckets=[16]", "sampling.decode_segments=1",
      "lora.rank=4", "advantage.eps=1e-3", "reward.function=test_sharding:digit_reward",
      "optim.learning_rate=1e-3", "optim.warmup_ratio=0.0", f"train.output_dir={out_dir}",
      # train.seed: T 1 draws that land within float rounding (1e-6) of a token boundary part the
      # runs; with the sampler's per-request keys the default seed's first step has one such.
      "train.seed=1", "logging.progress=false", "logging.tensorboard=false", *overrides)


def run(task, out_dir, mesh, *overrides: str, fused: bool = True) -> dict:
  """Greedy tokens, then 3 RL steps: metrics, each step's advantage inputs and output, final
  weights, and the live arrays (for their shardings)."""
  trainer = Trainer(config(task, out_dir, *overrides), mesh=mesh)
  assert trainer.fused == fused  # the default: one program per update
  calls = []
  program = trainer.advantage_fn

  def recorded(*args, cfg):
    out = program(*args, cfg=cfg)
    calls.append({"inputs": [np.asarray(a) for a in args], "advantage": np.asarray(out[0])})
    return out

  trainer.advantage_fn = recorded
  fused_update = trainer.fns.fused_update

  def recorded_fused(trainable, opt_state, frozen, reference, rollout, rewards_PxG):
    """The fused update (the default) computes the advantage inside its program: record the
    same inputs and output from what it returns."""
    out = fused_update(trainable, opt_state, frozen, reference, rollout, rewards_PxG)
    scored, groups = out[3], lambda x: np.asarray(x).reshape(*np.shape(rewards_PxG), -1)
    calls.append({"inputs": [np.asarray(rewards_PxG), groups(scored.entropy),
                             groups(scored.logp_old), groups(scored.logp_ref),
                             groups(rollout.completion_mask)],
                  "advantage": np.asarray(scored.advantage)})
    return out

  trainer.fns.fused_update = recorded_fused
  try:
    state = trainer.initial_state()
    greedy = Sampler(SamplingConfig(greedy=True, max_new_tokens=16, length_buckets=(16,)),
                     eos_ids=trainer.eos_ids, pad_id=trainer.pad_id, mesh=mesh)
    prompts = [e.prompt_ids for e in trainer.train_examples[:8]]
    out = greedy.sample(trainer.params(state.trainable), prompts, num_samples=1,
                        key=jax.random.key(0))
    metrics = []
    for _ in range(STEPS):
      state, m, _ = trainer.step(state)
      metrics.append({k: v for k, v in m.items() if not any(t in k for t in TIMING)})
    return {"tokens": np.asarray(out.tokens), "mask": np.asarray(out.mask),
            "metrics": metrics, "advantage_calls": calls, "program": program,
            "advantage_cfg": trainer.cfg.advantage,
            "batch_axes": sharding.spec_for(("batch",), (8,), mesh)[0],
            "trainable": jax.tree.map(np.asarray, state.trainable),
            "arrays": {"trainable": state.trainable, "opt_state": state.opt_state,
                       "frozen": trainer.policy.frozen}}
  finally:
    trainer.close()


@pytest.fixture(scope="module")
def reference(task, tmp_path_factory):
  mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  return run(task, tmp_path_factory.mktemp("one-device"), mesh)


@pytest.fixture(scope="module", params=MESHES)
def sharded(request, task, tmp_path_factory):
  data, fsdp, tensor = request.param
  mesh = make_mesh(MeshConfig(data, fsdp, tensor))
  return request.param, run(task, tmp_path_factory.mktemp("mesh"), mesh)


def test_sharded_run_matches_one_device(sharded, reference):
  _, got = sharded
  assert_same_run(got, reference)


def test_packed_sharded_run_matches_one_device(task, tmp_path_factory):
  # train.packing on every mesh axis: packed rows split over data x fsdp (the row count a
  # multiple of 4 shards), heads and MLP over tensor; three steps as on one device.
  packed = ("train.packing=true",)
  one = run(task, tmp_path_factory.mktemp("packed-one"),
            make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]), *packed)
  # On fsdp x tensor meshes the packed fused program deadlocked in XLA:CPU's collectives, so
  # the trainer runs the separate programs there (and says so).
  got = run(task, tmp_path_factory.mktemp("packed-mesh"), make_mesh(MeshConfig(2, 2, 2)), *packed,
            fused=False)
  assert_same_run(got, one)
  got = run(task, tmp_path_factory.mktemp("packed-data-fsdp"), make_mesh(MeshConfig(2, 4, 1)),
            *packed)
  assert_same_run(got, one)


def test_packed_accumulated_sharded_run_matches_one_device(task, tmp_path_factory):
  # Packing with gradient accumulation: each micro-batch packed apart, its rows split over
  # data x fsdp; heads and MLP over tensor.
  flags = ("train.packing=true", "train.grad_accumulation=2")
  one = run(task, tmp_path_factory.mktemp("acc-one"),
            make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]), *flags, fused=False)
  for mesh in ((2, 2, 2), (1, 4, 2)):
    got = run(task, tmp_path_factory.mktemp("acc-mesh"), make_mesh(MeshConfig(*mesh)), *flags,
              fused=False)
    assert_same_run(got, one)


def assert_same_run(got, reference):
  """Greedy tokens equal, metrics and final weights within the tolerance of another
  summation order, and a real learning signal."""
  assert len(np.unique(reference["tokens"])) >= 3  # not a constant model
  np.testing.assert_array_equal(got["tokens"], reference["tokens"])  # greedy sampler
  np.testing.assert_array_equal(got["mask"], reference["mask"])
  for step, (a, b) in enumerate(zip(got["metrics"], reference["metrics"])):
    assert a.keys() == b.keys()
    for k in a:
      # The sampler/trainer mismatch measures rounding itself (1e-6..1e-5 in float32), and the
      # one-device sampler runs other kernels than a mesh's: equal to that size only.
      atol = 1e-4 if k.startswith(("sampling/sampling_logp", "rollout_corr/")) else 1e-5
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=atol, err_msg=f"step {step + 1}: {k}")
  # Adam divides by the root of the second moment: 1e-6 gradient differences from another
  # reduction order can move a weight by ~1e-5 after a few steps; a sharding error moves it by far more.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
               got["trainable"], reference["trainable"])
  for m in reference["metrics"]:  # real learning signal, not float noise
    assert m["reward_std"] > 0.01 and m["grad_norm"] > 1e-2, m


def test_sharded_advantages_match_one_device(sharded, reference):
  """Each step's advantage inputs (rewards, entropies, old and reference log-probs, mask) and
  advantages match; the sharded advantage program on the one-device inputs gives the
  one-device advantage, its groups split over data x fsdp."""
  _, got = sharded
  assert len(got["advantage_calls"]) == len(reference["advantage_calls"]) == STEPS
  names = ("rewards", "entropy", "logp_old", "logp_ref", "mask")
  for step, (a, b) in enumerate(zip(got["advantage_calls"], reference["advantage_calls"])):
    # Step 1 samples and scores with the same weights (1e-5); later steps with weights that
    # Adam has moved apart by up to 1e-4 (assert_same_run), e.g. log-probs 1.3e-5 apart at
    # step 3 on an AMD EPYC (Zen 4).
    tol = 1e-5 if step == 0 else 1e-4
    for name, x, y in zip(names, a["inputs"], b["inputs"]):
      np.testing.assert_allclose(x, y, rtol=tol, atol=tol, err_msg=f"step {step + 1}: {name}")
    # The bucket z-scores divide by within-bucket spreads, which magnifies the 1e-6
    # differences of the inputs; on identical inputs (below) the match is 1e-5.
    np.testing.assert_allclose(a["advantage"], b["advantage"], rtol=1e-4, atol=1e-4,
                               err_msg=f"step {step + 1}: advantage")
    adv = got["program"](*b["inputs"], cfg=got["advantage_cfg"])[0]
    assert adv.sharding.spec[0] == got["batch_axes"]
    np.testing.assert_allclose(np.asarray(adv), b["advantage"], rtol=1e-5, atol=1e-5,
                               err_msg=f"step {step + 1}: advantage on the same inputs")
  last = reference["advantage_calls"][-1]
  assert np.abs(last["advantage"]).max() > 0
  assert np.abs(last["inputs"][2] - last["inputs"][3]).max() > 1e-3  # the progress term is live


def _specs(tree) -> dict[str, P]:
  return {sharding.path_str(path): getattr(x, "sharding", x).spec
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_parameters_and_optimizer_state_are_sharded_as_declared(sharded):
  (data, fsdp, tensor), got = sharded
  arrays = got["arrays"]
  mesh = jax.tree.leaves(arrays["frozen"])[0].sharding.mesh
  for name in ("trainable", "opt_state", "frozen"):
    declared = _specs(sharding.state_shardings(arrays[name], mesh, param_rules(preset("test-tiny"))))
    actual = _specs(arrays[name])
    assert declared.keys() == actual.keys()
    for path, spec in declared.items():
      assert actual[path] == spec, (name, path)

  frozen, trainable = _specs(arrays["frozen"]), _specs(arrays["trainable"])
  opt = _specs(arrays["opt_state"])
  f = "fsdp" if fsdp > 1 else None
  t = "tensor" if tensor > 1 else None
  assert frozen["layers.0.attn.q.base.kernel"] == P(f, t)
  assert frozen["layers.0.mlp.down.base.kernel"] == P(t, f)
  assert frozen["embed"][1] == f
  assert trainable["layers.0.attn.q.lora_a"] == P(f, None)
  assert trainable["layers.0.mlp.up.lora_b"] == P(None, t)
  moments = [p for p in opt if p.endswith("layers.0.attn.o.lora_b")]
  assert len(moments) == 2  # Adam's mu and nu, sharded like their parameter
  assert all(opt[p] == P(None, f) for p in moments)
  if fsdp > 1 or tensor > 1:  # FSDP / tensor parallelism really splits the weights
    q = jax.tree_util.tree_flatten_with_path(arrays["frozen"])[0]
    kernel = next(x for p, x in q if sharding.path_str(p) == "layers.0.attn.q.base.kernel")
    assert kernel.addressable_shards[0].data.size == kernel.size // (fsdp * tensor)


def test_batch_not_divisible_by_mesh_is_a_config_error(task, tmp_path):
  cfg = config(task, tmp_path / "run").override("train.prompts_per_step=3",
                                                "train.num_generations=2")
  with pytest.raises(ValueError, match=r"train\.prompts_per_step x train\.num_generations"):
    Trainer(cfg, mesh=make_mesh(MeshConfig(8, 1, 1)))


def test_mesh_config_fills_the_free_axis_and_rejects_mismatches():
  assert MeshConfig().shape(8) == (8, 1, 1)
  assert MeshConfig(data=2, fsdp=-1, tensor=2).shape(8) == (2, 2, 2)
  assert make_mesh(MeshConfig(1, -1, 2)).shape == {"data": 1, "fsdp": 4, "tensor": 2}
  with pytest.raises(ValueError, match="do not divide"):
    MeshConfig(data=3, fsdp=-1).shape(8)
  with pytest.raises(ValueError, match="data\\*fsdp\\*tensor = 4"):
    MeshConfig(2, 2, 1).shape(8)
  with pytest.raises(ValueError, match="at most one axis"):
    MeshConfig(-1, -1, 1)


def test_declared_specs_for_cache_and_batches():
  """KV cache: rows over data x fsdp, KV heads over tensor; indivisible dimensions replicate."""
  from epgrpo_jax.models import init_cache
  mesh = make_mesh(MeshConfig(2, 2, 2))
  cache = jax.eval_shape(lambda: init_cache(preset("test-tiny"), 8, 32))
  specs = sharding.cache_shardings(cache, mesh)
  assert specs["k"][0].spec == P(("data", "fsdp"), "tensor", None, None)
  assert specs["v"][1].spec == P(("data", "fsdp"), "tensor", None, None)
  assert specs["valid"].spec == P(("data", "fsdp"), None)
  assert specs["index"].spec == P()
  assert sharding.batch_sharding(mesh, 2).spec == P(("data", "fsdp"), None)
  assert sharding.leading_sharding(mesh, (6, 3)).spec == P(None)  # 4 shards do not divide 6
  # Vocabulary 97 is prime: the embedding stays whole along it, split over fsdp along D.
  rules = param_rules(preset("test-tiny"))
  assert sharding.param_sharding("embed", (97, 32), mesh, rules).spec == P(None, "fsdp")
  assert sharding.param_sharding("unknown.weight", (4, 4), mesh, rules).spec == P()


def test_sharded_rematerialised_update_matches_plain_update():
  """The update program on a (2, 2, 2) mesh with `remat` gives the one-device update."""
  from epgrpo_jax.core import losses
  from epgrpo_jax.training import batches, objective, programs
  from epgrpo_jax.models import LoraConfig
  from helpers import random_model, tiny_config

  tx, _ = objective.make_optimizer(1e-2, 10, warmup_ratio=0.0, weight_decay=0.0, max_grad_norm=1.0)
  rng = np.random.default_rng(0)
  b, tp, n = 8, 4, 6
  batch = batches.UpdateBatch(
      batches.CompletionBatch(rng.integers(0, 97, (b, tp)).astype(np.int32), np.ones((b, tp), bool),
                    rng.integers(0, 97, (b, n)).astype(np.int32), rng.random((b, n)) < 0.8),
      logp_old=np.zeros((b, n), np.float32), logp_ref=-rng.random((b, n)).astype(np.float32),
      advantage=rng.standard_normal((b, n)).astype(np.float32))
  results = []
  for remat, mesh in ((False, None), (True, make_mesh(MeshConfig(2, 2, 2)))):
    model = random_model(tiny_config(remat=remat), lora=LoraConfig(rank=4, alpha=8.0), seed=3)
    policy = programs.Policy.from_model(model, full_finetune=False)
    shardings = None if mesh is None else programs.StepShardings.create(policy, tx, mesh)
    fns = programs.StepFunctions(policy.graphdef, tx, loss_cfg=losses.LossConfig(), temperature=1.0,
                              on_policy=True, shardings=shardings, model_cfg=model.cfg)
    opt_state = tx.init(policy.trainable)
    trainable, opt_state, metrics = fns.update(policy.trainable, opt_state, policy.frozen,
                                               jax.tree.map(jax.numpy.asarray, batch))
    if mesh is not None:
      assert _specs(trainable)["layers.0.attn.q.lora_b"] == P(None, "tensor")
    results.append((jax.tree.map(np.asarray, trainable), jax.device_get(metrics)))
  (tr_a, m_a), (tr_b, m_b) = results
  assert m_a["grad_norm"] > 0
  for k in m_a:
    np.testing.assert_allclose(m_b[k], m_a[k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6), tr_a, tr_b)


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_gathered_head_keeps_values_and_gradients_on_an_fsdp_mesh(tied):
  """Full fine-tuning on an fsdp=8 mesh, where the seam gathers the LM head once before the
  chunked log-probs (`Kernels.constrain`, "head": behind an optimization barrier): log-probs,
  entropies and every parameter's gradient (the head's, or with a tied head the embedding's,
  which sums the lookup's and the head's) are those of the same mesh without the gather and of
  one device; without a mesh, or where fsdp does not split the head, it is the identity."""
  from flax import nnx
  from epgrpo_jax.kernels import seam
  from epgrpo_jax.models import param_rules
  from epgrpo_jax.training import batches, objective
  from helpers import random_model, tiny_config

  cfg = tiny_config(tie_word_embeddings=tied)  # hidden 32 splits over fsdp = 8, vocab 97
  graphdef, state = nnx.split(random_model(cfg, seed=5))
  rng = np.random.default_rng(1)
  b, tp, n = 8, 4, 6
  rollout = jax.tree.map(jax.numpy.asarray, batches.CompletionBatch(
      rng.integers(0, 97, (b, tp)).astype(np.int32), np.ones((b, tp), bool),
      rng.integers(0, 97, (b, n)).astype(np.int32), rng.random((b, n)) < 0.8))
  weight_BxN = jax.numpy.asarray(rng.standard_normal((b, n)), np.float32)

  def loss(state, kernels):
    stats = objective.completion_logprobs(nnx.merge(graphdef, state), rollout, temperature=0.7,
                                          kernels=kernels, token_chunk=4, vocab_chunk=32)
    return jax.numpy.sum(weight_BxN * (stats[0] + 0.1 * stats[1])), stats

  def run(mesh, gather=True):
    kernels = seam.choose(cfg, mesh, constrain=True)
    if not gather:  # the head as the model holds it (split over fsdp), as before the seam gathered it
      kernels = dataclasses.replace(kernels, constrain=lambda x, kind="hidden", c=kernels.constrain:
                                    x if kind == "head" else c(x, kind))
    fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    placed = state if mesh is None else jax.device_put(
        state, sharding.state_shardings(state, mesh, param_rules(cfg)))
    lowered = fn.lower(placed, kernels)
    (value, stats), grads = lowered.compile()(placed)
    return jax.device_get((value, stats, nnx.to_pure_dict(grads))), lowered.as_text()

  mesh = make_mesh(MeshConfig(1, 8, 1))
  head = "embed" if tied else "lm_head"
  # The head's hidden axis is split: [V, D] tied (the embedding), [D, V] untied.
  assert sharding.state_shardings(state, mesh, param_rules(cfg))[head].get_value().spec[
      1 if tied else 0] == "fsdp"
  (one, one_text), (split, split_text), (kept, kept_text) = run(None), run(mesh), run(mesh, False)
  assert "optimization_barrier" in split_text
  assert "optimization_barrier" not in one_text and "optimization_barrier" not in kept_text
  assert np.abs(one[2][head]).max() > 0
  jax.tree.map(lambda x, y: np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7), kept, split)
  # Against one device, the sums run in another order over the mesh (with or without the gather:
  # up to 1.5e-5 on the embedding rows of repeated tokens, gradients of order one).
  jax.tree.map(lambda x, y: np.testing.assert_allclose(y, x, rtol=1e-4, atol=5e-5), one, split)
  x = jax.numpy.ones((32, 97))
  assert seam.choose(cfg, None, constrain=True).constrain(x, "head") is x
  assert sharding.activation_constraints(make_mesh(MeshConfig(8, 1, 1)))(x, "head") is x
