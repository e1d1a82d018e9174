"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from pagedserve.models.alibi import BloomForCausalLM, MptForCausalLM
from pagedserve.models.cohere import Cohere2ForCausalLM, Cohere2MoeForCausalLM, CohereForCausalLM
from pagedserve.models.dbrx import DbrxForCausalLM
from pagedserve.models.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    Glm4MoeLiteForCausalLM,
    MiniCPM3ForCausalLM,
    YoutuForCausalLM,
)
from pagedserve.models.falcon_h1 import FalconH1ForCausalLM
from pagedserve.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GemmaForCausalLM,
    VaultGemmaForCausalLM,
)
from pagedserve.models.gemma3n import Gemma3nForCausalLM
from pagedserve.models.gemma4 import Gemma4ForCausalLM
from pagedserve.models.gpt2 import (
    BioGptForCausalLM,
    GPT2LMHeadModel,
    GPTBigCodeForCausalLM,
    GPTNeoForCausalLM,
    OPTForCausalLM,
)
from pagedserve.models.gpt_oss import GptOssForCausalLM
from pagedserve.models.hybrid import (
    BambaForCausalLM,
    GraniteMoeHybridForCausalLM,
    JambaForCausalLM,
    Lfm2ForCausalLM,
    Lfm2MoeForCausalLM,
    Lfm3ForCausalLM,
    Mamba2ForCausalLM,
    MambaForCausalLM,
    NemotronHForCausalLM,
)
from pagedserve.models.kimi_linear import KimiLinearForCausalLM
from pagedserve.models.llama import (
    Ernie4_5ForCausalLM,
    Exaone4ForCausalLM,
    Glm4ForCausalLM,
    GlmForCausalLM,
    GraniteForCausalLM,
    GraniteSWAForCausalLM,
    HeliumForCausalLM,
    HunYuanDenseV1ForCausalLM,
    HyperCLOVAXForCausalLM,
    InternLM3ForCausalLM,
    LlamaForCausalLM,
    Ministral3ForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    SeedOssForCausalLM,
    SmolLM3ForCausalLM,
)
from pagedserve.models.llama4 import Llama4ForCausalLM
from pagedserve.models.minicpm5 import MiniCPM5MoeForCausalLM
from pagedserve.models.minimax import MiniMaxForCausalLM, MiniMaxM2ForCausalLM
from pagedserve.models.moe import (
    AfmoeForCausalLM,
    Dots1ForCausalLM,
    Ernie4_5_MoeForCausalLM,
    ExaoneMoeForCausalLM,
    Glm4MoeForCausalLM,
    GraniteMoeForCausalLM,
    GraniteMoeSharedForCausalLM,
    GraniteMoeSWAForCausalLM,
    HunYuanMoEV1ForCausalLM,
    HYV3ForCausalLM,
    MellumForCausalLM,
    MixtralForCausalLM,
    PhimoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
    SolarOpenForCausalLM,
)
from pagedserve.models.neox import (
    FalconForCausalLM,
    GPTNeoXForCausalLM,
    PersimmonForCausalLM,
    StableLmForCausalLM,
)
from pagedserve.models.olmo import (
    FlexOlmoForCausalLM,
    Olmo2ForCausalLM,
    Olmo3ForCausalLM,
    OlmoeForCausalLM,
    OlmoForCausalLM,
)
from pagedserve.models.olmo_hybrid import OlmoHybridForCausalLM
from pagedserve.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from pagedserve.models.ungated import (
    ApertusForCausalLM,
    ArceeForCausalLM,
    GPTJForCausalLM,
    Jais2ForCausalLM,
    NanoChatForCausalLM,
    NemotronForCausalLM,
    PhiForCausalLM,
    Starcoder2ForCausalLM,
)
from pagedserve.models.zamba2 import Zamba2ForCausalLM

# every architecture served is Llama-family (Gemma's and OLMo's on its layers, with decoder layers of
# their own; the mixtures of experts on its layers, with experts for MLPs): the model runner and `fused_decode` use
# its typed attributes
MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "InternLM3ForCausalLM": InternLM3ForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "HunYuanDenseV1ForCausalLM": HunYuanDenseV1ForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma3nForCausalLM": Gemma3nForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "HYV3ForCausalLM": HYV3ForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "MambaForCausalLM": MambaForCausalLM,
    "FalconMambaForCausalLM": MambaForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "GPTJForCausalLM": GPTJForCausalLM,
    "GPTNeoForCausalLM": GPTNeoForCausalLM,
    "FlexOlmoForCausalLM": FlexOlmoForCausalLM,
    "HyperCLOVAXForCausalLM": HyperCLOVAXForCausalLM,
    "YoutuForCausalLM": YoutuForCausalLM,
    "NanoChatForCausalLM": NanoChatForCausalLM,
    "GraniteSWAForCausalLM": GraniteSWAForCausalLM,
    "GraniteMoeSWAForCausalLM": GraniteMoeSWAForCausalLM,
    "AfmoeForCausalLM": AfmoeForCausalLM,
    "Cohere2MoeForCausalLM": Cohere2MoeForCausalLM,
    "BloomForCausalLM": BloomForCausalLM,
    "MptForCausalLM": MptForCausalLM,
    "DbrxForCausalLM": DbrxForCausalLM,
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "HunYuanMoEV1ForCausalLM": HunYuanMoEV1ForCausalLM,
    "PersimmonForCausalLM": PersimmonForCausalLM,
    "BioGptForCausalLM": BioGptForCausalLM,
    "HeliumForCausalLM": HeliumForCausalLM,
    "CwmForCausalLM": LlamaForCausalLM,
    "MinistralForCausalLM": LlamaForCausalLM,
    "VaultGemmaForCausalLM": VaultGemmaForCausalLM,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "ArceeForCausalLM": ArceeForCausalLM,
    "NemotronForCausalLM": NemotronForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "ApertusForCausalLM": ApertusForCausalLM,
    "Jais2ForCausalLM": Jais2ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeSharedForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "SolarOpenForCausalLM": SolarOpenForCausalLM,
    "ExaoneMoeForCausalLM": ExaoneMoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
    "MiniCPM3ForCausalLM": MiniCPM3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "OlmoForCausalLM": OlmoForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "Zamba2ForCausalLM": Zamba2ForCausalLM,
    "MiniMaxForCausalLM": MiniMaxForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM,
    "OlmoHybridForCausalLM": OlmoHybridForCausalLM,
    "MiniCPM5MoeForCausalLM": MiniCPM5MoeForCausalLM,
    "MellumForCausalLM": MellumForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in MODELS:
        raise ValueError(f"model: architecture {architecture!r} is not supported ({', '.join(MODELS)} are)")
    return MODELS[architecture]
