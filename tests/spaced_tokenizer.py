"""A tokenizer that reads `spaces_between_special_tokens`, as transformers 4's slow tokenizers did (fast
tokenizers such as the default model's, and transformers 5's, ignore it: they decode the same either way)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast


class SpacedSpecialTokens(PreTrainedTokenizerFast):
    """Decodes as transformers 4's slow tokenizers did: each special token and each run of other tokens
    decoded apart, joined with spaces unless spaces_between_special_tokens=False."""

    def _decode(  # type: ignore[override]
        self,
        token_ids: list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        spaces_between_special_tokens: bool = True,
        **kwargs: object,
    ) -> str:
        special, parts, run = set(self.all_special_ids), [], []
        for token_id in token_ids:
            if token_id not in special:
                run.append(token_id)
            elif not skip_special_tokens:  # a skipped one splits no run
                parts += [super()._decode(run)] if run else []
                parts.append(self.convert_ids_to_tokens(token_id))
                run = []
        parts += [super()._decode(run)] if run else []
        return (" " if spaces_between_special_tokens else "").join(parts)
