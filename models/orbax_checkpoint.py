"""A model's params as an orbax checkpoint, restored straight into the mesh's shardings.

A checkpoint folder (what `jaxllm convert` writes) holds config.json, the tokenizer
files, and the params under `orbax/`: the model's nnx.State as a plain nested dict
({"layers": {0: {"self_attn": {"qkv_proj": {"kernel": array}}}}, ...}: the fused
projections as the model holds them, not HF's tensors), saved by orbax's
StandardCheckpointer. Restoring builds the model abstractly (shapes, dtypes and each
param's NamedSharding from the logical-axis rules), and orbax reads every param
into that sharding: each device reads only its shard, and the whole model is never
gathered on one device or in host memory. A param saved in another dtype is cast on
the way in, so a bf16 checkpoint serves in fp32 on CPU. `update_weights(folder)` reads
the params the same way, a layer at a time.
"""
from __future__ import annotations

import os
import typing
from collections.abc import Iterator

import jax

if typing.TYPE_CHECKING:  # the front end asks is_orbax_checkpoint when it resolves a config: no flax there
    from flax import nnx

    from jaxllm.models.config import ModelArchConfig

PARAMS_DIR = "orbax"  # the subfolder that marks a folder as an orbax checkpoint


def is_orbax_checkpoint(folder: str) -> bool:
    return os.path.isdir(os.path.join(folder, PARAMS_DIR))


def save_model(model: nnx.Module, folder: str) -> str:
    """Write the model's params to folder/orbax (which must not exist yet); returns that path."""
    import orbax.checkpoint as ocp
    from flax import nnx
    path = os.path.join(os.path.abspath(folder), PARAMS_DIR)
    if os.path.exists(path):
        raise ValueError(f"{path} already exists: convert into a new folder")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, nnx.to_pure_dict(nnx.state(model)))
        checkpointer.wait_until_finished()
    return path


def restore_model(folder: str, config: ModelArchConfig, *, dtype, mesh: jax.sharding.Mesh) -> nnx.Module:
    """The model of `config` with its params read from folder/orbax, each straight into
    its NamedSharding on `mesh` and cast to `dtype`. A checkpoint whose params differ
    from the model's (names or shapes), or that cannot be read, raises a ValueError."""
    from flax import nnx

    from jaxllm.models.loader import abstract_params, param_shardings
    graphdef, abstract = abstract_params(config, dtype, mesh=mesh)  # the model without any array
    shardings = param_shardings(abstract, mesh)
    targets = {path: jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=shardings[path])
               for path, var in abstract.items()}
    values = dict(restore_params(folder, targets))
    return nnx.merge(graphdef, nnx.from_flat_state([(path, var.replace(values[path]))
                                                    for path, var in abstract.items()]))


def restore_params(folder: str, targets: dict[tuple, jax.ShapeDtypeStruct], by_layer: bool = False
                   ) -> Iterator[tuple[tuple, jax.Array]]:
    """(path, param) for every target (path -> the param's shape, dtype and sharding), read from
    folder/orbax straight into its sharding and cast to its dtype. The checkpoint's names and shapes
    are checked against all the targets before the first param comes (ValueError naming them).
    by_layer: read a layer at a time (the embedding, the norm and the head each alone), so that a
    caller replacing its params one by one holds at most one layer's new ones beside the old."""
    import orbax.checkpoint as ocp
    from flax import traverse_util
    path = os.path.join(os.path.abspath(folder), PARAMS_DIR)
    with ocp.PyTreeCheckpointer() as checkpointer:
        try:
            saved = checkpointer.metadata(path).item_metadata  # a TreeMetadata; None without one
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable orbax checkpoint: {e}") from e
        if saved is None:
            raise ValueError(f"{path} is not a readable orbax checkpoint (no params metadata in it)")
        _check_params_match(path, saved.tree, traverse_util.unflatten_dict(targets))
        groups = {}  # by_layer: ("layers", 3) -> that layer's paths, ("norm",) -> its one; else () -> all
        for p in targets:
            group = () if not by_layer else p[:2] if len(p) > 2 and isinstance(p[1], int) else p[:1]
            groups.setdefault(group, []).append(p)
        for group in groups.values():
            item = traverse_util.unflatten_dict({p: targets[p] for p in group})
            try:
                restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                    item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=by_layer))
            except Exception as e:  # orbax wraps tensorstore's errors (a truncated file, ...) in a bare Exception
                detail = str(e.__cause__ or e).splitlines()[0]
                raise ValueError(f"orbax checkpoint {path} cannot be restored (corrupt or incomplete?): "
                                 f"{detail}") from e
            yield from traverse_util.flatten_dict(restored).items()


def _check_params_match(path: str, saved, target) -> None:
    """Same param names and shapes in the checkpoint as in the model (dtypes may differ)."""
    def shapes(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
        return {".".join(str(getattr(k, "key", k)) for k in keys): tuple(leaf.shape) for keys, leaf in leaves}
    have, want = shapes(saved), shapes(target)
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    wrong = [f"{name} {have[name]} (the model's: {want[name]})" for name in sorted(set(want) & set(have))
             if have[name] != want[name]]
    problems = [f"{what}: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
                for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                if names]
    if problems:
        raise ValueError(f"orbax checkpoint {path} does not match the model its config.json describes "
                         f"({'; '.join(problems)})")
