// quickstart: the README's C++ snippet as a whole program. Two engines in one process over
// tcp;ofi_rxm on loopback: the "decode" engine registers a paged buffer and hands its descriptor
// over as bytes; the "prefill" engine interns it and writes 64 pages into every third page of it
// with one PagedWrites, each WRITE carrying immediate 7; the decode engine counts 64 of them, and
// then every byte of the buffer is checked. Prints one line; exits 1 on any failure.
//
// Against an installed fabric-lib (`cmake --install build --prefix PREFIX`):
//   cmake -S examples/cpp -B build/example-cpp -DCMAKE_PREFIX_PATH=PREFIX
//   cmake --build build/example-cpp && build/example-cpp/quickstart
// `make example-cpp` does this, and `make test` too (tests/install/run.sh), which also checks that
// the README's snippet is the block between the README markers below, word for word.
#include <fabric/fabric.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <vector>

int main() {
  try {
    // [README: Using it]
    const uint64_t page_len = 4096;
    const uint32_t pages = 64;                // the sender writes 64 of its pages...
    std::vector<uint8_t> kv(256 * page_len);  // ...into a 256-page buffer of the receiver
    std::vector<uint8_t> src(pages * page_len);
    for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 131 + i / page_len);

    fabric::EngineConfig cfg;                       // provider "tcp;ofi_rxm"; "efa" in production
    cfg.nics = {{"", "127.0.0.1"}};                 // per NIC: {domain name, source address}
    cfg.worker_poll = fabric::PollMode::kAdaptive;  // kBusy (the default) wants a core per worker
    fabric::TransferEngine decode(cfg), prefill(cfg);  // one process here; two hosts in production

    // Receiver: registers its buffer; the descriptor goes to the sender as bytes, out of band.
    auto [kv_handle, kv_desc] = decode.reg_mr(kv.data(), kv.size());
    std::vector<uint8_t> desc_bytes = kv_desc.to_bytes();
    // Sender: registers its pages and interns the receiver's region once.
    fabric::MrHandle src_handle = prefill.reg_mr(src.data(), src.size()).first;
    fabric::RemoteMr dst = prefill.add_remote(fabric::MrDesc::from_bytes(desc_bytes));

    // Receiver: done once immediate 7 has been counted `pages` times, whatever the order.
    std::atomic<int> landed{fabric::kDonePending};
    decode.expect_imm_count(/*imm=*/7, /*count=*/pages, fabric::OnDone::flag(&landed),
                            {.timeout = std::chrono::seconds(10)});
    // Sender: one WRITE per page, its page i to the receiver's page 3 * i, each with immediate 7.
    std::vector<uint32_t> src_pages(pages), dst_pages(pages);
    for (uint32_t i = 0; i < pages; i++) src_pages[i] = i, dst_pages[i] = 3 * i;
    std::promise<fabric::Status> sent;  // set on the engine's callback thread
    prefill.submit(fabric::PagedWrites{.page_len = page_len,
                                       .src = src_handle,
                                       .src_pages = {src_pages, page_len, 0},
                                       .dst = dst,
                                       .dst_pages = {dst_pages, page_len, 0},
                                       .imm = 7},
                   fabric::OnDone::callback([&](const fabric::Status& s) { sent.set_value(s); }));
    landed.wait(fabric::kDonePending);  // the engine stores and notifies the flag
    // [/README]

    fabric::Status write = sent.get_future().get();  // the sender's side: its WRITEs completed
    if (!write.ok()) {
      std::fprintf(stderr, "quickstart: FAILED: the write ended with %s\n",
                   write.message().c_str());
      return 1;
    }
    if (landed.load() != fabric::kDoneSucceeded) {
      std::fprintf(stderr, "quickstart: FAILED: %llu of %u immediates counted within 10 s\n",
                   static_cast<unsigned long long>(decode.imm_count(7)), pages);
      return 1;
    }
    // Every byte: the receiver's page 3 * i holds the sender's page i, every other page is 0.
    uint64_t bad = 0;
    for (uint64_t p = 0; p < kv.size() / page_len; p++) {
      const bool written = p % 3 == 0 && p / 3 < pages;
      for (uint64_t b = 0; b < page_len; b++)
        bad += kv[p * page_len + b] != (written ? src[p / 3 * page_len + b] : 0);
    }
    decode.dereg_mr(kv_handle);
    prefill.dereg_mr(src_handle);
    std::printf(
        "quickstart: %u pages of %llu B over %s, %u immediates counted, %zu bytes checked: %s\n",
        pages, static_cast<unsigned long long>(page_len), decode.main_address().provider().c_str(),
        pages, kv.size(), bad == 0 ? "OK" : "FAILED");
    return bad == 0 ? 0 : 1;
  } catch (const fabric::Error& e) {  // every synchronous error: a code and what to do about it
    std::fprintf(stderr, "quickstart: FAILED: %s\n", e.what());
    return 1;
  }
}
