pil_to_tensor = None  # imported by transformers.image_utils, called only on images
