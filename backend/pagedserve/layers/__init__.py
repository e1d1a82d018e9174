"""Model building blocks; tensor parallelism lives here so model files stay small."""
