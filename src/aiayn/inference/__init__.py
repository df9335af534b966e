"""From a trained model to text: model-agnostic search and the text-in, text-out translator."""
