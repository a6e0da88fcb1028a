"""A wrong special-token guess in transformers' GGUF conversion, simulated: what transformers
5.17 did to SmolLM2's file (its GGUFLlamaConverter swapped bos and eos, so the converted
tokenizer's eos was <|im_start|>, id 1). Used by test_embedded_conversion.py and by
tests/integration/test_embedded_model.py."""

import importlib

# where releases of transformers bind the converter's entry point (5.17: imported into the
# tokenizer module; 5.24: read from integrations.gguf at each call) and the checkpoint reader
CONVERTERS = (
    "transformers.tokenization_utils_tokenizers",
    "transformers.integrations.gguf",
    "transformers.integrations.ggml",
)
READERS = ("transformers.modeling_gguf_pytorch_utils", "transformers.configuration_utils")


def wrong_eos(patch) -> None:
    """With `patch` (a pytest MonkeyPatch), make the GGUF conversion of this transformers
    name <|im_start|> the eos, on the tokenizer (the converter's extra settings, which
    override the file's) and in the config (eos id 1)."""

    def converting(original):
        def convert(*args, **kwargs):
            tokenizer, extra = original(*args, **kwargs)
            return tokenizer, {**extra, "eos_token": "<|im_start|>"}

        return convert

    def reading(original):
        def read(*args, **kwargs):
            out = original(*args, **kwargs)
            out["config"]["eos_token_id"] = 1
            return out

        return read

    for names, attribute, wrap in (
        (CONVERTERS, "convert_gguf_tokenizer", converting),
        (READERS, "load_gguf_checkpoint", reading),
    ):
        for name in names:
            module = importlib.import_module(name)
            original = getattr(module, attribute, None)
            if original is not None:
                patch.setattr(module, attribute, wrap(original))
