"""Key sources: which keys a scan reads (the admin listing, lease-free sizing) and the sample of them."""
