"""Reading model artifacts: config (ModelConfig; every config spelling is settled here),
safetensors weights and headers, GGUF import, the Hugging Face cache and Hub. Modules
import mlx only inside the functions that need it, so listing models stays cheap."""
