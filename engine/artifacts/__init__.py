"""Reading model artifacts: config (ModelConfig), safetensors weights and headers, GGUF
import, the Hugging Face cache and Hub, the loader that turns them into a model, and
``inspect``. Modules import mlx only inside the functions that need it, so listing and
inspecting models stays cheap."""
