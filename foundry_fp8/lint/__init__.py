"""`foundry-fp8 lint`: FP8 mistakes in LLM-Foundry train YAMLs, found before GPU time is spent."""
