"""Models of other toolkits: Hugging Face Marian import and export (`marian`), CTranslate2
export (`ctranslate2`)."""
