ImageReadMode = decode_image = None  # imported by transformers.image_utils, called only on images
