"""The ``model`` section against a checkpoint's own ``config.json``: with ``model.path`` set, the
architecture keys a run config states must describe that model (they cannot change it)."""

from __future__ import annotations

from pathlib import Path

# ModelConfig key -> the Hugging Face config.json field it describes
HF_FIELDS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
             "max_position_embeddings": "max_position_embeddings", "tie_word_embeddings": "tie_word_embeddings",
             "family": "model_type"}


def model_config_json(path: str | Path) -> dict:
    """``path/config.json`` as a dict (a named error for a missing or damaged one)."""
    from ..rundir.jsonfile import read_json_object

    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"model.path {str(path)!r} has no config.json (not a Hugging Face model directory)")
    return read_json_object(f, "the model's config")


def check_architecture(cfg, hf_config: dict) -> None:
    """With ``model.path`` set, every architecture key the run config states (``model.family``,
    ``model.hidden_size``, ...) must describe the model at that path: it cannot change a
    trained model, and silently ignoring it would record an architecture in ``config.yaml``
    that the run did not have. Refused by name, with both values."""
    wrong = []
    for key, value in cfg.architecture_given().items():
        field = HF_FIELDS[key]
        have = hf_config.get(field)
        if key == "num_kv_heads" and have is None:  # absent in config.json: as many as attention heads
            have = hf_config.get("num_attention_heads")
        if key == "tie_word_embeddings" and have is None:
            have = True  # transformers' PretrainedConfig default
        if have != value:
            wrong.append(f"model.{key}: {value!r} but the model's config.json has {field}: {have!r}")
    if wrong:
        raise ValueError(f"model.path {cfg.path!r} holds another architecture than the config states ("
                         + "; ".join(wrong) + "); model keys cannot change a saved model: remove them, or "
                         "point model.path at a model that has them")
