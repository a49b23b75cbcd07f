"""Sources, scene generator, tokenisation, vocabulary, the prepare step and its tables."""
