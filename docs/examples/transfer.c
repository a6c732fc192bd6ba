/* Transfers from C: a server engine grants a host buffer, a client engine
 * WRITEs into it and READs it back, both in this process (the server
 * accepts on a thread: the handshake needs both sides). With
 * GDR_BACKEND=sim both contexts are nodes of one simulated fabric; on
 * real hardware they meet over the NIC's address. Build:
 *   gcc -std=c11 -pthread transfer.c $(pkg-config --cflags --libs gdr) */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gdr.h>

#define LEN 65536

static int ok(gdr_result r, const char *what) {
  if (r == GDR_RESULT_OK) return 1;
  char why[512] = "";
  gdr_last_error_message(why, sizeof why, NULL);
  fprintf(stderr, "%s: %s (%s)\n", what, gdr_result_message(r), why);
  return 0;
}

struct accepting {
  gdr_listener listener;
  gdr_peer peer;
  gdr_result result;
};

static void *accept_one(void *arg) {
  struct accepting *a = arg;
  a->result = gdr_listener_accept(a->listener, 10000, &a->peer);
  return NULL;
}

int main(void) {
  static unsigned char served[LEN], sent[LEN], back[LEN];
  for (size_t i = 0; i < LEN; i++) sent[i] = (unsigned char)(i * 13 + 1);

  gdr_context server_ctx, client_ctx;
  gdr_engine server, client;
  if (!ok(gdr_context_new(NULL, &server_ctx), "context") ||
      !ok(gdr_context_new(NULL, &client_ctx), "context") ||
      !ok(gdr_engine_new(server_ctx, NULL, &server), "engine") ||
      !ok(gdr_engine_new(client_ctx, NULL, &client), "engine"))
    return 1;

  /* The server listens on its first NIC's address; the client connects
   * while a thread of the server accepts. */
  char ip[64], addr[96];
  gdr_listener listener;
  if (!ok(gdr_engine_nic_address(server, 0, ip, sizeof ip, NULL), "address")) return 1;
  snprintf(addr, sizeof addr, "%s:0", ip);
  if (!ok(gdr_engine_listen(server, addr, &listener), "listen") ||
      !ok(gdr_listener_local_addr(listener, addr, sizeof addr, NULL), "local address"))
    return 1;
  struct accepting accepting = {.listener = listener};
  pthread_t thread;
  pthread_create(&thread, NULL, accept_one, &accepting);
  gdr_peer to_server;
  gdr_result connected = gdr_engine_connect(client, addr, 10000, &to_server);
  pthread_join(thread, NULL);
  if (!ok(connected, "connect") || !ok(accepting.result, "accept")) return 1;
  gdr_peer to_client = accepting.peer;

  /* Buffers the caller owns, wrapped and registered on each engine. */
  gdr_buffer b_served, b_sent, b_back;
  gdr_region r_served, r_sent, r_back;
  if (!ok(gdr_buffer_wrap(server_ctx, (uint64_t)(uintptr_t)served, LEN, &b_served), "wrap") ||
      !ok(gdr_buffer_wrap(client_ctx, (uint64_t)(uintptr_t)sent, LEN, &b_sent), "wrap") ||
      !ok(gdr_buffer_wrap(client_ctx, (uint64_t)(uintptr_t)back, LEN, &b_back), "wrap") ||
      !ok(gdr_region_register(server, b_served, 0, LEN, &r_served), "register") ||
      !ok(gdr_region_register(client, b_sent, 0, LEN, &r_sent), "register") ||
      !ok(gdr_region_register(client, b_back, 0, LEN, &r_back), "register"))
    return 1;

  /* The server grants its buffer; the client receives the descriptor. */
  gdr_grant grant;
  uint64_t grant_id;
  gdr_descriptor remote;
  if (!ok(gdr_peer_grant(to_client, r_served, 0, LEN, GDR_RIGHTS_READ_WRITE, &grant), "grant") ||
      !ok(gdr_grant_id(grant, &grant_id), "grant id") ||
      !ok(gdr_peer_wait_grant(to_server, grant_id, 10000, &remote), "wait grant"))
    return 1;

  /* One batch WRITEs, the next READs back in two transfers. */
  gdr_transfer write = {GDR_OP_WRITE, r_sent, 0, remote, 0, LEN};
  gdr_transfer reads[2] = {{GDR_OP_READ, r_back, 0, remote, 0, LEN / 2},
                           {GDR_OP_READ, r_back, LEN / 2, remote, LEN / 2, LEN / 2}};
  gdr_batch batch;
  if (!ok(gdr_peer_submit(to_server, &write, 1, 0, &batch), "submit") ||
      !ok(gdr_batch_wait(batch, 10000), "WRITE") || !ok(gdr_batch_free(batch), "free") ||
      !ok(gdr_peer_submit(to_server, reads, 2, 0, &batch), "submit") ||
      !ok(gdr_batch_wait(batch, 10000), "READ") || !ok(gdr_batch_free(batch), "free"))
    return 1;
  int same = memcmp(served, sent, LEN) == 0 && memcmp(back, sent, LEN) == 0;
  printf("transfer: %s\n", same ? "the server holds what was written; read back equal" : "MISMATCH");

  /* Everything freed: grants and regions before the buffers they cover. */
  gdr_descriptor_free(remote);
  gdr_grant_revoke(grant);
  gdr_peer_free(to_server);
  gdr_peer_free(to_client);
  gdr_listener_free(listener);
  gdr_region_free(r_served);
  gdr_region_free(r_sent);
  gdr_region_free(r_back);
  gdr_engine_free(server);
  gdr_engine_free(client);
  gdr_buffer_free(b_served);
  gdr_buffer_free(b_sent);
  gdr_buffer_free(b_back);
  gdr_context_free(server_ctx);
  gdr_context_free(client_ctx);
  return same ? 0 : 1;
}
