"""Images, frozen encoders, feature extraction and the feature store."""
