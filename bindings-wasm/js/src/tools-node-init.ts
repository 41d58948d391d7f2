// Instantiates the tools' WebAssembly module synchronously, so Node users can call the API right
// after `import`.
import { readFileSync } from "node:fs";
import { initSync } from "./wasm/highwater_tools.js";

initSync({ module: readFileSync(new URL("./wasm/highwater_tools_bg.wasm", import.meta.url)) });
