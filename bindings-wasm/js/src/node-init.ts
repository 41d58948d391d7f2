// Instantiates the WebAssembly module synchronously, so Node users can call the API right after `import`.
import { readFileSync } from "node:fs";
import { initSync } from "./wasm/highwater_wasm.js";

initSync({ module: readFileSync(new URL("./wasm/highwater_wasm_bg.wasm", import.meta.url)) });
